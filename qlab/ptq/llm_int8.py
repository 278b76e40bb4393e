"""PLACEHOLDER: being written (replace this whole file)."""


def mixed_precision_matmul(*args, **kwargs):
    raise NotImplementedError("mixed_precision_matmul is being written")

