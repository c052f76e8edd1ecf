"""Root causes of the model-suite cases that fail today, one constant each, with a minimal repro.

Tests carry them as strict xfail reasons: when a fix lands, the case turns XPASS and its mark goes.
None is open today.
"""
