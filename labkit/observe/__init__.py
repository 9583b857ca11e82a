"""Instruments: counters the code under test does not write, and the row that shows them.

    commlog    what labkit's collective wrappers asked for: op, mesh dimension, bytes, time
    dispatch   CollectiveLog: every c10d call seen by a dispatch mode; allow or refuse by name
    netcount   bytes the kernel's TCP sockets really moved (Gloo), per process
    saved      SavedTensors: bytes autograd saves for backward (saved-tensor hooks)
    storage    nbytes(t) and storage_bytes(tensors): the one way bytes of memory are counted
    measured   Measured(what, measured, predicted, counter) and its table
    timeline   Timeline: spans (name, lane, start, end) of one rank's step, on one clock

Import the module you need (`from labkit.observe import commlog`); this package imports none of
them, so that using one never loads the others.
"""
