"""The reference block manager (see ``manager``) and its deliberately broken variants."""

from .manager import ReferenceManager

__all__ = ["ReferenceManager"]
