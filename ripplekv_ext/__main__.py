"""`python -m ripplekv_ext`: until the full CLI lands, `demo` shows the build and a tiny gather."""

import sys

import torch

import ripplekv_ext


def demo():
    print(ripplekv_ext.build_report())
    keys = torch.arange(2 * 8 * 4, dtype=torch.float32).reshape(1, 2, 8, 4)
    values = -keys
    indices = torch.tensor([[[0, 3, 7], [1, 2, 6]]])
    keys_c, values_c = ripplekv_ext.gather_kv(keys, values, indices)
    print(f"\ngather_kv: keys {tuple(keys.shape)} with indices {indices.tolist()} -> {tuple(keys_c.shape)}")
    print(keys_c[0, 0])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        demo()
        return 0
    print("usage: python -m ripplekv_ext demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
