"""PLACEHOLDER: being written (replace this whole file)."""


def fwht(*args, **kwargs):
    raise NotImplementedError("fwht is being written")


def hadamard(*args, **kwargs):
    raise NotImplementedError("hadamard is being written")


def random_rotation(*args, **kwargs):
    raise NotImplementedError("random_rotation is being written")

