"""All-to-all (dispatch/combine) backends: one module per backend plus the protocol."""

from moekit.dispatch.base import Dispatcher
from moekit.dispatch.registry import availability, dispatcher_class

__all__ = ["Dispatcher", "availability", "dispatcher_class"]
