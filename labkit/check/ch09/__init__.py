"""Checkers for chapter 09 (mixed precision). One module per exercise:

    loss_scaling     9.1  labkit.check.ch09.loss_scaler(MyScaler)
    fp8_blocks       9.2  labkit.check.ch09.block_quantizer(quantize, dequantize)
    trainer/         9.3  labkit.check.ch09.mixed_precision_trainer(MixedPrecisionTrainer)
    precision_state  9.4  labkit.check.ch09.state_bytes(predict)   storage sizes
    mxfp8            9.5  labkit.check.ch09.mx_quantizer(quantize_mx)
"""
from __future__ import annotations

from labkit.check.ch09 import fp8_blocks, loss_scaling, mxfp8, precision_state, trainer
from labkit.check.ch09.fp8_blocks import block_quantizer
from labkit.check.ch09.loss_scaling import (
                                            PATTERNS,
                                            gradscaler_decisions,
                                            loss_scaler,
                                            scaler_decisions,
)
from labkit.check.ch09.mxfp8 import mx_quantizer
from labkit.check.ch09.precision_state import measure_state, state_bytes
from labkit.check.ch09.trainer import mixed_precision_trainer

EXERCISES = {m.EXERCISE: (m.TITLE, m.POINTS)
             for m in (loss_scaling, fp8_blocks, trainer, precision_state, mxfp8)}
__all__ = ["EXERCISES", "PATTERNS", "block_quantizer", "gradscaler_decisions", "loss_scaler",
           "measure_state", "mixed_precision_trainer", "mx_quantizer", "scaler_decisions",
           "state_bytes"]
