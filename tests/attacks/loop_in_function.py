# One function never returns (the others are the reference's): only its tests are lost.
# target: reference
# where: suffix


def double(x):
    while True:
        pass
