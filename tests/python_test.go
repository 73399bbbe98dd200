package tests

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// The Python client (python/mooncake_fs) runs in child processes of
// Debian's python3: its unit tests, its ABI checked against package ioctl,
// its live tests against a real daemon, a killed client, and pip install.

// pythonDir is the absolute path of python/ in the module.
func pythonDir(t testing.TB) string {
	t.Helper()
	dir, err := filepath.Abs("../python")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "mooncake_fs", "__init__.py")); err != nil {
		t.Fatalf("no python package: %v", err)
	}
	return dir
}

var publicPython struct {
	once sync.Once
	dir  string
	err  error
}

// publicPythonDir is a copy of python/ that every user can read, for
// scripts that run as nobody: the checkout may be anywhere, under any
// mode (a clone in a mktemp -d directory is 0700).
func publicPythonDir(t testing.TB) string {
	t.Helper()
	src := pythonDir(t)
	publicPython.once.Do(func() {
		dir := filepath.Join(filepath.Dir(binDir), "python")
		if out, err := exec.Command("cp", "-r", src, dir).CombinedOutput(); err != nil {
			publicPython.err = fmt.Errorf("copy %s: %v: %s", src, err, out)
			return
		}
		if out, err := exec.Command("chmod", "-R", "a+rX", dir).CombinedOutput(); err != nil {
			publicPython.err = fmt.Errorf("chmod %s: %v: %s", dir, err, out)
			return
		}
		publicPython.dir = dir
	})
	if publicPython.err != nil {
		t.Fatal(publicPython.err)
	}
	return publicPython.dir
}

// pyEnv runs python with the package importable and env set (KEY=VALUE).
func pyEnv(t testing.TB, env []string, args ...string) string {
	t.Helper()
	requireTools(t, python)
	full := append([]string{"PYTHONPATH=" + pythonDir(t), "PYTHONDONTWRITEBYTECODE=1"}, env...)
	return run(t, "env", append(append(full, python), args...)...)
}

// TestPythonUnit runs the client's tests that need no daemon: the ABI
// against the C header (compiled with cc), the pool's lease lifetimes,
// the tensor helpers that need no torch, and the CUDA driver wrapper
// against a fake libcuda (compiled with cc).
func TestPythonUnit(t *testing.T) {
	requireNumpy(t)
	dir := pythonDir(t)
	for _, pat := range []string{"test_[au]*.py", "test_tensor_unit.py", "test_cudadrv_unit.py", "test_store_unit.py"} {
		out := pyEnv(t, nil, "-m", "unittest", "discover", "-v", "-s", filepath.Join(dir, "tests"), "-p", pat)
		if !strings.Contains(out, "OK") {
			t.Errorf("%s:\n%s", pat, out)
		}
		t.Logf("%s: %s", pat, lastLines(out, 2))
	}
}

// pyLayout is the output of "python -m mooncake_fs._abi".
type pyLayout struct {
	Magic    uint64            `json:"magic"`
	ABI      [2]uint32         `json:"abi"`
	Commands map[string]uint32 `json:"commands"`
	Structs  map[string]struct {
		Size   int               `json:"size"`
		Fields map[string][2]int `json:"fields"` // offset, size
	} `json:"structs"`
	Flags map[string]uint32 `json:"flags"`
	Batch map[string]int    `json:"batch"`
	Kinds map[string]uint32 `json:"kinds"`
	Key   map[string]uint64 `json:"key"`
}

// TestPythonABI checks the Python mirror of the ABI against package ioctl:
// constants, command numbers, struct sizes, and every field offset by
// decoding what the Go encoders write at the offset Python uses.
func TestPythonABI(t *testing.T) {
	requireTools(t, python)
	var l pyLayout
	if err := json.Unmarshal([]byte(pyEnv(t, nil, "-c", "import json, mooncake_fs._abi as a; print(json.dumps(a.layout()))")), &l); err != nil {
		t.Fatal(err)
	}
	if l.Magic != ioctl.MagicValue || l.ABI != [2]uint32{ioctl.ABIMajor, ioctl.ABIMinor} {
		t.Errorf("magic %#x abi %v, want %#x %d.%d", l.Magic, l.ABI, ioctl.MagicValue, ioctl.ABIMajor, ioctl.ABIMinor)
	}
	cmds := map[string]uint32{
		"MC_IOC_GET_MAGIC": ioctl.CmdGetMagic, "MC_IOC_GET_ABI_VERSION": ioctl.CmdGetABIVersion,
		"MC_IOC_REGISTER_BUFFER": ioctl.CmdRegisterBuffer, "MC_IOC_UNREGISTER_BUFFER": ioctl.CmdUnregisterBuffer,
		"MC_IOC_PUT_BUF": ioctl.CmdPutBuf, "MC_IOC_GET_BUF": ioctl.CmdGetBuf,
		"MC_IOC_PUT_VM": ioctl.CmdPutVM, "MC_IOC_GET_VM": ioctl.CmdGetVM, "MC_IOC_STAT": ioctl.CmdStat,
		"MC_IOC_BATCH_PUT": ioctl.CmdBatchPut, "MC_IOC_BATCH_GET": ioctl.CmdBatchGet,
		"MC_IOC_PUT_CUDA": ioctl.CmdPutCUDA, "MC_IOC_GET_CUDA": ioctl.CmdGetCUDA,
		"MC_IOC_PUT_KEY": ioctl.CmdPutKey, "MC_IOC_GET_KEY": ioctl.CmdGetKey,
		"MC_IOC_BATCH_PUTV": ioctl.CmdBatchPutV, "MC_IOC_BATCH_GETV": ioctl.CmdBatchGetV,
		"MC_IOC_BATCH_WAIT": ioctl.CmdBatchWait, "MC_IOC_BATCH_PUT_TABLE": ioctl.CmdBatchPutTable,
		"MC_IOC_BATCH_GET_TABLE": ioctl.CmdBatchGetTable,
		"MC_IOC_PUT_KEY_INLINE":  ioctl.CmdPutKeyInline, "MC_IOC_GET_KEY_INLINE": ioctl.CmdGetKeyInline,
	}
	if len(l.Commands) != len(cmds) {
		t.Errorf("python has %d commands, Go %d", len(l.Commands), len(cmds))
	}
	for name, want := range cmds {
		if got := l.Commands[name]; got != want {
			t.Errorf("%s = %#x, Go %#x", name, got, want)
		}
	}
	consts := map[string][2]uint64{
		"MC_FLAG_EXCL":       {uint64(l.Flags["MC_FLAG_EXCL"]), uint64(ioctl.FlagExcl)},
		"MC_FLAG_WHOLE":      {uint64(l.Flags["MC_FLAG_WHOLE"]), uint64(ioctl.FlagWhole)},
		"MC_FLAG_UPDATE":     {uint64(l.Flags["MC_FLAG_UPDATE"]), uint64(ioctl.FlagUpdate)},
		"MC_MAX_BATCH":       {uint64(l.Batch["MC_MAX_BATCH"]), ioctl.MaxBatch},
		"MC_BATCH_BUF":       {uint64(l.Batch["MC_BATCH_BUF"]), uint64(ioctl.BatchBuf)},
		"MC_BATCH_VM":        {uint64(l.Batch["MC_BATCH_VM"]), uint64(ioctl.BatchVM)},
		"key_bytes":          {uint64(l.Batch["key_bytes"]), ioctl.BatchKeyBytes},
		"MC_KIND_HOST":       {uint64(l.Kinds["MC_KIND_HOST"]), uint64(ioctl.KindHost)},
		"MC_KIND_CUDA":       {uint64(l.Kinds["MC_KIND_CUDA"]), uint64(ioctl.KindCUDA)},
		"MC_KIND_VM":         {uint64(l.Kinds["MC_KIND_VM"]), uint64(ioctl.KindVM)},
		"MC_REGISTER_DMABUF": {uint64(l.Flags["MC_REGISTER_DMABUF"]), uint64(ioctl.RegisterDmabuf)},
		"MC_SRC_CUDA":        {l.Key["MC_SRC_CUDA"], uint64(ioctl.SrcCUDA)},
		"MC_SRC_VM":          {l.Key["MC_SRC_VM"], uint64(ioctl.SrcVM)},
		"MC_MAX_META":        {l.Key["MC_MAX_META"], ioctl.MaxMeta},
		"MC_MAX_GPU":         {l.Key["MC_MAX_GPU_REFS"], ioctl.MaxGPURefs},
		"MC_MAX_SEGS":        {l.Key["MC_MAX_SEGS"], ioctl.MaxSegs},
		"MC_SEG_GPU":         {l.Key["MC_SEG_GPU"], ioctl.SegGPU},
		"MC_SRC_INLINE":      {l.Key["MC_SRC_INLINE"], uint64(ioctl.SrcInline)},
		"MC_INLINE_BYTES":    {l.Key["MC_INLINE_BYTES"], ioctl.InlineBytes},
	}
	for name, v := range consts {
		if v[0] != v[1] {
			t.Errorf("%s = %d, Go %d", name, v[0], v[1])
		}
	}

	// Each struct marshalled by Go with distinct field values; Python's
	// offset and size of the field must find that value.
	loc := [192]byte{'n', 'o', 'd', 'e'}
	var handle [64]byte
	handle[0], handle[63] = 0xAA, 0xBB
	batch := ioctl.BatchArg{Source: 1, ID: 0x77}
	if _, err := batch.AddKey("key", ioctl.BatchEntry{Flags: 5, Addr: 11, Len: 12, ObjOff: 13, Result: -2, Version: 15}); err != nil {
		t.Fatal(err)
	}
	key := ioctl.KeyArg{Header: ioctl.Header{Flags: 2}, Source: 1, KeyLen: 3, MetaLen: 4, ID: 5, Addr: 6, Len: 7, ObjOff: 8,
		Result: 9, Version: 10, ObjSize: 11}
	key.GPU.Handle[0], key.Meta[0], key.Key[0] = 0xAA, 'm', 'k'
	var vb ioctl.VBatchArg
	vb.Count, vb.NGPU = 2, 3
	vb.GPUs[0].Handle[0] = 0xDD
	vb.Area[0] = 'a'
	inline := make([]byte, ioctl.SizeKeyInlineArg)
	(&ioctl.KeyArg{Source: ioctl.SrcInline}).MarshalInlineInto(inline)
	inline[ioctl.SizeKeyArg] = 'd'
	type fv struct {
		field string
		want  uint64 // the value (little-endian, field-size bytes); for arrays, the first byte
	}
	cases := []struct {
		name   string
		wire   []byte
		size   int
		fields []fv
	}{
		{"mc_magic", ioctl.MagicArg{Header: ioctl.Header{Flags: 9}, Magic: 0x1122}.Marshal(), ioctl.SizeMagicArg,
			[]fv{{"h.size", ioctl.SizeMagicArg}, {"h.flags", 9}, {"magic", 0x1122}}},
		{"mc_abi_version", ioctl.ABIVersionArg{Major: 3, Minor: 4}.Marshal(), ioctl.SizeABIVersionArg,
			[]fv{{"major", 3}, {"minor", 4}}},
		{"mc_register", (&ioctl.RegisterArg{Fd: 7, Kind: 1, Len: 8, Offset: 4096, ID: 10, Handle: handle}).Marshal(), ioctl.SizeRegisterArg,
			[]fv{{"fd", 7}, {"kind", 1}, {"len", 8}, {"offset", 4096}, {"id", 10}, {"handle", 0xAA}}},
		{"mc_unregister", (&ioctl.UnregisterArg{ID: 33}).Marshal(), ioctl.SizeUnregisterArg, []fv{{"id", 33}}},
		{"mc_buf", (&ioctl.BufArg{ID: 1, BufOff: 2, Len: 3, ObjOff: 4, Result: 5, Version: 6}).Marshal(), ioctl.SizeBufArg,
			[]fv{{"id", 1}, {"buf_off", 2}, {"len", 3}, {"obj_off", 4}, {"result", 5}, {"version", 6}}},
		{"mc_vm", (&ioctl.VMArg{Addr: 1, Len: 2, ObjOff: 3, Result: 4, Version: 5}).Marshal(), ioctl.SizeVMArg,
			[]fv{{"addr", 1}, {"len", 2}, {"obj_off", 3}, {"result", 4}, {"version", 5}}},
		{"mc_stat", (&ioctl.StatArg{ObjSize: 1, Version: 2, Ino: 3, MtimeNs: 4, Mode: 5, Pinned: 6, Replicas: 7, Extents: 8, Location: loc}).Marshal(), ioctl.SizeStatArg,
			[]fv{{"size", 1}, {"version", 2}, {"ino", 3}, {"mtime_ns", 4}, {"mode", 5}, {"pinned", 6}, {"replicas", 7}, {"extents", 8}, {"location", 'n'}}},
		{"mc_cuda", (&ioctl.CUDAArg{Header: ioctl.Header{Flags: 3}, Handle: handle, DevOff: 1, Len: 2, ObjOff: 3, Result: 4, Version: 5, Device: [16]byte{0xCC}}).Marshal(), ioctl.SizeCUDAArg,
			[]fv{{"h.size", ioctl.SizeCUDAArg}, {"h.flags", 3}, {"handle", 0xAA}, {"dev_off", 1}, {"len", 2}, {"obj_off", 3}, {"result", 4}, {"version", 5}, {"device", 0xCC}}},
		{"mc_batch", batch.Marshal(), ioctl.SizeBatchArg,
			[]fv{{"count", 1}, {"source", 1}, {"id", 0x77}, {"keys", 'k'}}},
		{"mc_key", key.Marshal(), ioctl.SizeKeyArg,
			[]fv{{"h.flags", 2}, {"source", 1}, {"key_len", 3}, {"meta_len", 4}, {"id", 5}, {"addr", 6}, {"len", 7}, {"obj_off", 8},
				{"result", 9}, {"version", 10}, {"size", 11}, {"gpu", 0xAA}, {"meta", 'm'}, {"key", 'k'}}},
		{"mc_vbatch", vb.Marshal(), ioctl.SizeVBatchArg,
			[]fv{{"count", 2}, {"ngpu", 3}, {"gpus", 0xDD}, {"area", 'a'}}},
		{"mc_table", (&ioctl.TableArg{Count: 2, Source: 1, ID: 3, Entries: 4, Keys: 5, KeysLen: 6}).Marshal(), ioctl.SizeTableArg,
			[]fv{{"count", 2}, {"source", 1}, {"id", 3}, {"entries", 4}, {"keys", 5}, {"keys_len", 6}, {"pad", 0}}},
		{"mc_key_inline", inline, ioctl.SizeKeyInlineArg, []fv{{"k", ioctl.SizeKeyInlineArg & 0xff}, {"data", 'd'}}},
	}
	for _, c := range cases {
		s, ok := l.Structs[c.name]
		if !ok {
			t.Errorf("python has no %s", c.name)
			continue
		}
		if s.Size != c.size || len(c.wire) != c.size {
			t.Errorf("%s: python %d B, Go %d B (wire %d)", c.name, s.Size, c.size, len(c.wire))
		}
		for _, f := range c.fields {
			of, ok := s.Fields[f.field]
			if !ok {
				t.Errorf("%s.%s: not in python", c.name, f.field)
				continue
			}
			off, size := of[0], of[1]
			if size > 8 {
				size = 1 // arrays: their first byte
			}
			var buf [8]byte
			copy(buf[:], c.wire[off:off+size])
			if got := binary.LittleEndian.Uint64(buf[:]); got != f.want {
				t.Errorf("%s.%s at python offset %d (%d B): Go wrote %#x there, want %#x", c.name, f.field, off, size, got, f.want)
			}
		}
	}
	// The batch entry: Python's offsets inside mc_batch_entry, applied to
	// the first entry that Go wrote after the 24-byte batch head.
	e := l.Structs["mc_batch_entry"]
	if e.Size != ioctl.SizeBatchEntry {
		t.Errorf("mc_batch_entry: python %d B, Go %d", e.Size, ioctl.SizeBatchEntry)
	}
	wire := batch.Marshal()
	ent := wire[l.Structs["mc_batch"].Fields["entries"][0]:]
	for field, want := range map[string]uint64{"key_off": 0, "key_len": 3, "flags": 5, "addr": 11, "len": 12, "obj_off": 13, "result": uint64(1<<64 - 2), "version": 15} {
		of := e.Fields[field]
		var buf [8]byte
		copy(buf[:], ent[of[0]:of[0]+of[1]])
		if got := binary.LittleEndian.Uint64(buf[:]); got != want {
			t.Errorf("mc_batch_entry.%s at %d: %#x, want %#x", field, of[0], got, want)
		}
	}
}

// regStatus is the "registrations" part of "mooncake-fs status --json".
type regStatus struct {
	Live  int64 `json:"live"`
	Total int64 `json:"total"`
	Bytes int64 `json:"bytes"`
}

func (d *daemon) registrations(t testing.TB) regStatus {
	t.Helper()
	out := run(t, daemonBin(), "status", "--json", d.dir)
	var s struct {
		Registrations *regStatus `json:"registrations"`
	}
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	if s.Registrations == nil {
		t.Fatalf("status --json has no registrations:\n%s", out)
	}
	return *s.Registrations
}

// waitRegistrations waits until no registration is live (the kernel
// releases files, and so registrations, after the process is gone).
func (d *daemon) waitRegistrations(t testing.TB, live int64) regStatus {
	t.Helper()
	var r regStatus
	waitFor(t, fmt.Sprintf("registrations.live == %d", live), func() (bool, string) {
		r = d.registrations(t)
		return r.Live == live, fmt.Sprintf("%+v", r)
	})
	return r
}

// TestPythonLive runs python/tests/test_live.py against a daemon: round
// trips of every command from a separate process, numpy arrays of many
// dtypes, partial gets, EXCL, batches with missing keys, pools (one
// registration each, exhaustion policies, zero-copy view lifetimes), and
// a client killed with registrations outstanding.
func TestPythonLive(t *testing.T) {
	requireNumpy(t)
	d := startDaemon(t, "--size", "1GiB")
	dir := pythonDir(t)
	out := pyEnv(t, []string{"MOONCAKE_MOUNT=" + d.dir, "MOONCAKE_BIN=" + daemonBin()},
		"-m", "unittest", "discover", "-v", "-s", filepath.Join(dir, "tests"), "-p", "test_live.py")
	if strings.Contains(out, "skipped") {
		t.Errorf("live tests skipped something:\n%s", out)
	}
	t.Logf("%s", lastLines(out, 4))
	d.quiesce(t)
	if r := d.waitRegistrations(t, 0); r.Bytes != 0 || r.Total == 0 {
		t.Errorf("after the python clients: %+v, want nothing live and some made", r)
	}
	d.checkAlive(t)
}

// TestPythonStore runs python/tests/test_store_live.py: Mooncake's
// MooncakeDistributedStore on the mount, in the call patterns of SGLang
// HiCache, vLLM and LMCache, with Mooncake's codes for what fails, keys
// of every shape as files, a batch that outgrows the store (eviction is
// off), and a child killed with a registration open.
func TestPythonStore(t *testing.T) {
	requireTools(t, python)
	d := startDaemon(t, "--size", "128MiB", "--evict", "off")
	out := pyEnv(t, []string{"MOONCAKE_FS_MOUNT=" + d.dir, "MOONCAKE_BIN=" + daemonBin()},
		"-m", "unittest", "discover", "-v", "-s", filepath.Join(pythonDir(t), "tests"), "-p", "test_store_live.py")
	if strings.Contains(out, "skipped") || !strings.Contains(out, "OK") {
		t.Errorf("store tests:\n%s", out)
	}
	t.Logf("%s", lastLines(out, 2))
	d.quiesce(t)
	if r := d.waitRegistrations(t, 0); r.Bytes != 0 {
		t.Errorf("after the store clients: %+v, want nothing live", r)
	}
	d.checkAlive(t)
}

// killedClient makes two pools (one with a view outstanding) and a bare
// registration, then sleeps until killed.
const killedClient = `
import os, sys, time, mooncake_fs as mc
mount = sys.argv[1]
os.makedirs(os.path.join(mount, "k"), exist_ok=True)
pools = [mc.BufferPool(os.path.join(mount, "k"), 1 << 20, 4) for _ in range(2)]
pools[0].put("obj", b"payload")
view = pools[0].get_view("obj")
f = mc.File(os.path.join(mount, "k", "file"), "w")
fd = os.memfd_create("bare"); os.ftruncate(fd, 1 << 16)
f.register(fd, 1 << 16)
print("READY", pools[0].stats()["registrations"], pools[1].stats()["registrations"], flush=True)
time.sleep(600)
`

// TestPythonKilledClient kills a Python client with registrations and a
// zero-copy view outstanding: the daemon must release every registration
// (verified through status) and keep serving.
func TestPythonKilledClient(t *testing.T) {
	requireTools(t, python)
	d := startDaemon(t, "--size", "64MiB")
	before := d.registrations(t)
	b := background(t, "env", "PYTHONPATH="+pythonDir(t), python, "-c", killedClient, d.dir)
	b.waitOutput(t, "READY 1 1\n")
	r := d.registrations(t)
	if r.Live != before.Live+3 || r.Total != before.Total+3 {
		t.Errorf("with the client up: %+v, want 3 more than %+v (one per pool, one bare)", r, before)
	}
	if want := int64(2*4*(1<<20+4096) + 1<<16); r.Bytes-before.Bytes != want {
		t.Errorf("registered bytes %d, want %d", r.Bytes-before.Bytes, want)
	}
	// env exec()s python, so the process is the client itself.
	if err := b.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if _, err := b.wait(); err == nil {
		t.Fatal("client survived SIGKILL")
	}
	r = d.waitRegistrations(t, before.Live)
	if r.Bytes != before.Bytes {
		t.Errorf("after the kill: %+v, want %d bytes as before", r, before.Bytes)
	}
	d.quiesce(t)
	out := pyEnv(t, nil, "-c", `import sys, mooncake_fs as mc; print(mc.get(sys.argv[1]))`, d.path("k", "obj"))
	if strings.TrimSpace(out) != "b'payload'" {
		t.Errorf("after the kill: %q", out)
	}
	d.checkAlive(t)
}

// TestPythonInstall builds and installs the package with pip, offline (no
// index), into a target directory, and imports it from there.
func TestPythonInstall(t *testing.T) {
	requireTools(t, python)
	if out, err := runErr(python, "-m", "pip", "--version"); err != nil {
		t.Skipf("%s has no pip: %v\n%s", python, err, out)
	}
	target := t.TempDir()
	run(t, "env", "PIP_DISABLE_PIP_VERSION_CHECK=1", python, "-m", "pip", "install", "--no-index", "--no-cache-dir",
		"--target", target, pythonDir(t))
	out := run(t, "env", "PYTHONPATH="+target, "PYTHONDONTWRITEBYTECODE=1", python, "-c",
		"import mooncake_fs, importlib.metadata as m; print(mooncake_fs.__file__); print(m.version('mooncake-fs'))")
	if !strings.HasPrefix(out, filepath.Join(target, "mooncake_fs")) || !strings.Contains(out, "0.1.0") {
		t.Errorf("installed package not imported from %s:\n%s", target, out)
	}
	// The mooncake.store stand-in, a package of its own.
	run(t, "env", "PIP_DISABLE_PIP_VERSION_CHECK=1", python, "-m", "pip", "install", "--no-index", "--no-cache-dir",
		"--target", target, filepath.Join(pythonDir(t), "compat"))
	out = run(t, "env", "PYTHONPATH="+target, "PYTHONDONTWRITEBYTECODE=1", python, "-c",
		"import mooncake.store as s, mooncake_fs.mooncake_store as m; print(s.__file__, s.MooncakeDistributedStore is m.MooncakeDistributedStore)")
	if !strings.HasPrefix(out, filepath.Join(target, "mooncake", "store.py")) || !strings.Contains(out, "True") {
		t.Errorf("mooncake.store not the installed stand-in:\n%s", out)
	}
}

// lastLines returns the last n lines of s.
func lastLines(s string, n int) string {
	var lines []string
	for l := range strings.SplitSeq(s, "\n") {
		if l = strings.TrimSpace(l); l != "" && strings.Trim(l, "-=") != "" {
			lines = append(lines, l)
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
