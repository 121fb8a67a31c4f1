"""SLA autoscaling: the policy (pure), the replica providers, and the loop `ember up` runs."""
