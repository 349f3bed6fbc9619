"""The I/O half of a kvpush worker: a Node over its Links, DataPath and Interpreter."""

from kvpush.node.interpreter import Outcome
from kvpush.node.node import Node, NodeConfig, Source

__all__ = ["Node", "NodeConfig", "Outcome", "Source"]
