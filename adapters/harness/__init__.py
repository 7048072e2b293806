"""The vLLM-facing calls shared by kvspec's adapters and its standalone reproducers.

Each module here imports only vLLM and the standard library.  The adapters build vLLM's
objects through these functions, and a reproducer is the straight-line record of the very
calls an adapter made (``kvspec.adapters.recording``), so the two cannot drift apart.
"""
