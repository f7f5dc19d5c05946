"""Distributed algorithms: the Join context manager for uneven inputs."""

from .elastic import recover
from .join import ElasticJoinable, Join, Joinable, JoinHook

__all__ = ["Join", "Joinable", "JoinHook", "ElasticJoinable", "recover"]
