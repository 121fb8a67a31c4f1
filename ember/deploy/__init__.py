"""Deploying a fleet file beyond one machine: Kubernetes manifests and the Helm chart (`ember deploy k8s`)."""
