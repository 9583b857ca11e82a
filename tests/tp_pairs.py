"""What the TP tests compare with the one-process reference on each rank: every gradient and
every parameter of the TP model, gathered whole (labkit.tp's gathers), next to the reference's."""
from labkit.tp import gather_tp_grads, gather_tp_state


def grad_pairs(tp_model, ref, label: str) -> dict:
    """{f"{label} grad NAME": (the TP model's gradient, gathered whole; the reference's)}."""
    grads = gather_tp_grads(tp_model)
    return {f"{label} grad {name}": (grads[name], p.grad) for name, p in ref.named_parameters()}


def param_pairs(tp_model, ref, label: str) -> dict:
    """{f"{label} NAME": (the TP model's parameter, gathered whole; the reference's)}."""
    state = gather_tp_state(tp_model)
    return {f"{label} {name}": (state[name], p.detach()) for name, p in ref.named_parameters()}
