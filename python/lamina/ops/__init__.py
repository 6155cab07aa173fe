"""Autograd Functions and the functional API (re-exported by ``lamina``).

Submodules: ``delta_rule`` (chunked delta-rule family), ``prism_attention``, ``hrm_update``.
"""
