"""Code that reaches into a model framework's internals, one subpackage per framework.

The core library imports these lazily, only where it needs the framework, so ``import ripplekv_ext`` stays free
of them.
"""
