"""The differential harness behind test_differential.py.

programs.py writes random array programs (hypothesis) as Python source over a
namespace `xp`; oracle.py runs that same source with numpy (and JAX where the
table of documented differences says XLA's answer is Tessel's) and bounds the
rounding error a float result may carry; test_differential.py runs it
through Tessel in every mode and compares.
"""
