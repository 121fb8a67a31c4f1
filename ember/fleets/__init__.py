"""Fleet files that ship with Ember (`ember up` with no argument runs default.yaml)."""
