"""labkit: the companion package of the book "Training large models across many GPUs".

Nothing happens at import time; import the module you need:

    from labkit.launch import run        # a function on N real processes
    from labkit import collectives, costs, model
"""
__version__ = "0.1.0"
