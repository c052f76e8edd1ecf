"""Root causes of the model-suite cases that fail today, one constant each, with a minimal repro.

Tests carry them as strict xfail reasons: when a fix lands, the case turns XPASS and its mark goes.
"""

CHECKPOINT_MAP_LOCATION_NEURON = (
    "device serialization (since e62ae8b): torch.load(cpu_checkpoint, map_location='neuron') returns CPU "
    "tensors (every mode, and outside an engine); before e62ae8b it raised AttributeError (torch.neuron had "
    "no `device` for torch.storage._to). Where the neuron location is dropped is not pinned down. Repro: "
    "`b = io.BytesIO(); torch.save(torch.ones(2), b); b.seek(0); torch.load(b, map_location='neuron').device` "
    "-> cpu")
