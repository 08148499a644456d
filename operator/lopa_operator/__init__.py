"""Kubernetes operator for LoPADeployment: renders and supervises one master and a worker group."""

__version__ = "0.1.0"
