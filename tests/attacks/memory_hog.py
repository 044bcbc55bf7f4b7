# One function allocates memory until the kernel stops it (bounded at 16 GB).
# target: reference
# where: suffix


def double(x):
    hog = []
    for _ in range(160):
        hog.append(bytearray(100 * 2**20))
        hog[-1][::4096] = b"x" * len(range(0, 100 * 2**20, 4096))
    return 2 * x
