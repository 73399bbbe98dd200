"""The Python ABI mirror against the C header ioctl/mooncake_fs.h.

Compiles a small C program against the header with cc and compares every
struct size, field offset and size, command number and constant with
mooncake_fs._abi. Skips when cc or the header is missing (an installed
package without the source tree). MOONCAKE_FS_HEADER overrides the header
path.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mooncake_fs import _abi  # noqa: E402

HEADER = os.environ.get("MOONCAKE_FS_HEADER") or os.path.join(HERE, "..", "..", "ioctl", "mooncake_fs.h")

CONSTANTS = {
    "MC_MAGIC": _abi.MAGIC,
    "MC_ABI_MAJOR": _abi.ABI_MAJOR,
    "MC_ABI_MINOR": _abi.ABI_MINOR,
    "MC_IOC_TYPE": _abi.IOC_TYPE,
    "MC_KIND_HOST": _abi.KIND_HOST,
    "MC_KIND_CUDA": _abi.KIND_CUDA,
    "MC_REGISTER_DMABUF": _abi.REGISTER_DMABUF,
    "MC_FLAG_EXCL": _abi.FLAG_EXCL,
    "MC_FLAG_UPDATE": _abi.FLAG_UPDATE,
    "MC_FLAG_PARENTS": _abi.FLAG_PARENTS,
    "MC_FLAG_WHOLE": _abi.FLAG_WHOLE,
    "MC_MAX_BATCH": _abi.MAX_BATCH,
    "MC_BATCH_BUF": _abi.BATCH_BUF,
    "MC_BATCH_VM": _abi.BATCH_VM,
    "MC_KIND_VM": _abi.KIND_VM,
    "MC_SRC_BUF": _abi.SRC_BUF,
    "MC_SRC_VM": _abi.SRC_VM,
    "MC_SRC_CUDA": _abi.SRC_CUDA,
    "MC_MAX_META": _abi.MAX_META,
    "MC_MAX_GPU_REFS": _abi.MAX_GPU_REFS,
    "MC_MAX_SEGS": _abi.MAX_SEGS,
    "MC_SEG_VM": _abi.SEG_VM,
    "MC_SEG_GPU": _abi.SEG_GPU,
    "MC_VBATCH_ASYNC": _abi.VBATCH_ASYNC,
    "MC_MAX_ASYNC_CALLS": _abi.MAX_ASYNC_CALLS,
    "MC_MAX_TABLE": _abi.MAX_TABLE,
    "MC_MAX_TABLE_KEY_BYTES": _abi.MAX_TABLE_KEY_BYTES,
    "MC_SRC_INLINE": _abi.SRC_INLINE,
    "MC_INLINE_BYTES": _abi.INLINE_BYTES,
}


def c_program():
    header = os.path.abspath(HEADER).replace("\\", "\\\\").replace('"', '\\"')
    lines = ["#include <stdio.h>", "#include <stddef.h>", f'#include "{header}"', "int main(void) {"]
    for name, (cls, fields) in _abi.STRUCTS.items():
        lines.append(f'  printf("size {name} %zu\\n", sizeof(struct {name}));')
        for f in fields:
            lines.append(
                f'  printf("field {name} {f} %zu %zu\\n", offsetof(struct {name}, {f}), '
                f"sizeof(((struct {name} *)0)->{f}));"
            )
    for name in _abi.COMMANDS:
        lines.append(f'  printf("cmd {name} %llu\\n", (unsigned long long)({name}));')
    for name in CONSTANTS:
        lines.append(f'  printf("const {name} %llu\\n", (unsigned long long)({name}));')
    lines.append('  printf("keys %zu\\n", sizeof(((struct mc_batch *)0)->keys));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


def c_layout():
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise unittest.SkipTest("no C compiler (cc)")
    if not os.path.exists(HEADER):
        raise unittest.SkipTest(f"no header at {HEADER}")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "abi.c"), os.path.join(tmp, "abi")
        with open(src, "w") as f:
            f.write(c_program())
        subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-o", exe, src], check=True, capture_output=True, text=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    return [line.split() for line in out.splitlines()]


class TestABI(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        try:
            cls.rows = c_layout()
        except subprocess.CalledProcessError as e:
            raise AssertionError(f"compiling against {HEADER} failed:\n{e.stderr}") from None

    def test_struct_sizes(self):
        sizes = {r[1]: int(r[2]) for r in self.rows if r[0] == "size"}
        self.assertEqual(set(sizes), set(_abi.STRUCTS))
        for name, (cls, _) in _abi.STRUCTS.items():
            with self.subTest(struct=name):
                self.assertEqual(_abi.ctypes.sizeof(cls), sizes[name])
                self.assertEqual(sizes[name], _abi.SIZES[name][1])

    def test_field_offsets(self):
        n = 0
        for r in self.rows:
            if r[0] != "field":
                continue
            name, field, off, size = r[1], r[2], int(r[3]), int(r[4])
            cls = _abi.STRUCTS[name][0]
            with self.subTest(struct=name, field=field):
                self.assertEqual(_abi.offset_of(cls, field), off)
                self.assertEqual(_abi.field_size(cls, field), size)
            n += 1
        self.assertGreater(n, 50)

    def test_every_c_field_is_mirrored(self):
        # Fields of the C structs in declaration order end where the next
        # begins: the mirrored fields must tile each struct (no field missed).
        for name, (cls, fields) in _abi.STRUCTS.items():
            top = [f for f in fields if "." not in f]
            spans = sorted((_abi.offset_of(cls, f), _abi.field_size(cls, f)) for f in top)
            end = 0
            for off, size in spans:
                self.assertLessEqual(end, off, f"{name}: overlapping fields")
                end = off + size
            self.assertEqual(end, _abi.ctypes.sizeof(cls), f"{name}: fields do not reach the end")
            self.assertEqual(len(top), len(cls._fields_), f"{name}: not every field is checked")

    def test_commands(self):
        cmds = {r[1]: int(r[2]) for r in self.rows if r[0] == "cmd"}
        self.assertEqual(cmds, _abi.COMMANDS)

    def test_constants(self):
        consts = {r[1]: int(r[2]) for r in self.rows if r[0] == "const"}
        self.assertEqual(consts, CONSTANTS)
        keys = [int(r[1]) for r in self.rows if r[0] == "keys"]
        self.assertEqual(keys, [_abi.BATCH_KEY_BYTES])

    def test_command_fields(self):
        # type 'M', argument size in bits 16..29, read/write direction.
        for name, cmd in _abi.COMMANDS.items():
            with self.subTest(cmd=name):
                self.assertEqual((cmd >> 8) & 0xFF, ord("M"))
                self.assertLessEqual((cmd >> 16) & 0x3FFF, _abi.MAX_ARG_SIZE)
                self.assertLess(cmd, 1 << 32)


if __name__ == "__main__":
    unittest.main()
