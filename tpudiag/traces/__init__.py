"""Readers of profiler trace formats (Kineto JSON, XPlane)."""
