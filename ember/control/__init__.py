"""Process control for one machine: `ember up` runs a gateway and its local replicas as supervised
child processes. Talks to them only by starting, signalling and probing them over HTTP."""
