"""A minimal PEP 517 build backend for the pure-Python mooncake_fs package.

It has no dependencies, so pip can build offline with build isolation:
it writes the wheel (mooncake_fs/*.py plus .dist-info) and the sdist with
the standard library alone. Metadata comes from pyproject.toml's [project].
"""

import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile

# The project being built: the directory above this file's (abspath keeps
# a symlinked copy's own place: python/compat/_build links here).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _package():
    """The one top-level package the project ships: [tool.mooncake_fs_build]
    package, else mooncake_fs."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        m = re.search(r'^\[tool\.mooncake_fs_build\][^\[]*?^package\s*=\s*"([A-Za-z_][A-Za-z0-9_]*)"', f.read().decode(),
                      re.M | re.S)
    return m.group(1) if m else "mooncake_fs"


PACKAGE = _package()


def _project():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        text = f.read().decode()
    try:
        import tomllib

        return tomllib.loads(text)["project"]
    except ImportError:  # Python < 3.11: the few keys we need
        proj = text.split("[project]", 1)[1].split("\n[", 1)[0]
        get = lambda k: re.search(r'^%s\s*=\s*"([^"]*)"' % k, proj, re.M).group(1)  # noqa: E731
        return {"name": get("name"), "version": get("version"), "description": get("description"),
                "requires-python": get("requires-python"), "optional-dependencies": {"numpy": ["numpy"]}}


def _names():
    p = _project()
    return p, re.sub(r"[-_.]+", "_", p["name"]).lower(), p["version"]


def _metadata():
    p, _, version = _names()
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {p['name']}",
        f"Version: {version}",
        f"Summary: {p.get('description', '')}",
        f"Requires-Python: {p.get('requires-python', '>=3.8')}",
    ]
    for c in p.get("classifiers", []):
        lines.append(f"Classifier: {c}")
    for extra, reqs in p.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {r}; extra == "{extra}"' for r in reqs]
    readme = os.path.join(ROOT, "README.md")
    body = ""
    if os.path.exists(readme):
        lines.append("Description-Content-Type: text/markdown")
        with open(readme, encoding="utf-8") as f:
            body = f.read()
    return "\n".join(lines) + "\n\n" + body


def _wheel_meta(tag="py3-none-any"):
    return f"Wheel-Version: 1.0\nGenerator: mooncake_fs_build\nRoot-Is-Purelib: true\nTag: {tag}\n"


def _sources():
    pkg = os.path.join(ROOT, PACKAGE)
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith((".py", ".typed")):
                full = os.path.join(dirpath, name)
                yield full, os.path.relpath(full, ROOT).replace(os.sep, "/")


def _write_wheel(wheel_directory, files):
    """files: [(archive name, bytes)]; returns the wheel's file name."""
    _, dist, version = _names()
    info = f"{dist}-{version}.dist-info"
    files = list(files) + [(f"{info}/METADATA", _metadata().encode()), (f"{info}/WHEEL", _wheel_meta().encode())]
    record = []
    name = f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in files:
            z.writestr(zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0)), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arc},sha256={digest},{len(data)}")
        record.append(f"{info}/RECORD,,")
        z.writestr(zipfile.ZipInfo(f"{info}/RECORD", date_time=(1980, 1, 1, 0, 0, 0)), "\n".join(record) + "\n")
    return name


def _read(path):
    with open(path, "rb") as f:
        return f.read()


# --- PEP 517 hooks ---

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _, dist, version = _names()
    info = f"{dist}-{version}.dist-info"
    os.makedirs(os.path.join(metadata_directory, info), exist_ok=True)
    with open(os.path.join(metadata_directory, info, "METADATA"), "w", encoding="utf-8") as f:
        f.write(_metadata())
    with open(os.path.join(metadata_directory, info, "WHEEL"), "w") as f:
        f.write(_wheel_meta())
    return info


prepare_metadata_for_build_editable = prepare_metadata_for_build_wheel


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, [(arc, _read(full)) for full, arc in _sources()])


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _, dist, _ = _names()
    return _write_wheel(wheel_directory, [(f"__editable__.{dist}.pth", (ROOT + "\n").encode())])


def build_sdist(sdist_directory, config_settings=None):
    _, dist, version = _names()
    base = f"{dist}-{version}"
    name = f"{base}.tar.gz"
    members = [(os.path.join(ROOT, "pyproject.toml"), "pyproject.toml"),
               (os.path.abspath(__file__), "_build/" + os.path.basename(__file__))]
    for extra in ("README.md",):
        if os.path.exists(os.path.join(ROOT, extra)):
            members.append((os.path.join(ROOT, extra), extra))
    members += list(_sources())
    tests = os.path.join(ROOT, "tests")
    if os.path.isdir(tests):
        members += [(os.path.join(tests, n), f"tests/{n}") for n in sorted(os.listdir(tests)) if n.endswith(".py")]
    # dereference: a symlinked backend (python/compat) goes in as the file.
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz", format=tarfile.PAX_FORMAT, dereference=True) as t:
        for full, arc in members:
            t.add(full, f"{base}/{arc}", recursive=False)
        pkg_info = _metadata().encode()
        ti = tarfile.TarInfo(f"{base}/PKG-INFO")
        ti.size = len(pkg_info)
        t.addfile(ti, io.BytesIO(pkg_info))
    return name
