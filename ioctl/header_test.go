package ioctl

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestCHeader compiles a program against mooncake_fs.h and checks every
// struct size, field offset and command number it prints against Go.
func TestCHeader(t *testing.T) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skip("no C compiler")
	}
	dir := t.TempDir()
	src := `#include <stdio.h>
#include <stddef.h>
#include "mooncake_fs.h"
#define S(t) printf("sizeof %s %zu\n", #t, sizeof(struct t));
#define O(t, f) printf("offsetof %s.%s %zu\n", #t, #f, offsetof(struct t, f));
#define C(c) printf("cmd %s %lu\n", #c, (unsigned long)(c));
int main(void) {
	S(mc_magic) S(mc_abi_version) S(mc_register) S(mc_unregister) S(mc_buf) S(mc_vm) S(mc_stat) S(mc_batch_entry) S(mc_batch) S(mc_cuda) S(mc_key) S(mc_gpu_ref) S(mc_seg) S(mc_vbatch_entry) S(mc_vbatch) S(mc_table) S(mc_key_inline)
	O(mc_key_inline, k) O(mc_key_inline, data)
	O(mc_register, fd) O(mc_register, kind) O(mc_register, len) O(mc_register, offset) O(mc_register, id) O(mc_register, handle)
	O(mc_buf, id) O(mc_buf, buf_off) O(mc_buf, len) O(mc_buf, obj_off) O(mc_buf, result) O(mc_buf, version)
	O(mc_vm, addr) O(mc_vm, len) O(mc_vm, obj_off) O(mc_vm, result) O(mc_vm, version)
	O(mc_stat, size) O(mc_stat, version) O(mc_stat, ino) O(mc_stat, mtime_ns) O(mc_stat, mode) O(mc_stat, pinned) O(mc_stat, replicas) O(mc_stat, extents) O(mc_stat, location)
	O(mc_batch_entry, key_off) O(mc_batch_entry, key_len) O(mc_batch_entry, flags) O(mc_batch_entry, addr) O(mc_batch_entry, len) O(mc_batch_entry, obj_off) O(mc_batch_entry, result) O(mc_batch_entry, version)
	O(mc_cuda, handle) O(mc_cuda, dev_off) O(mc_cuda, len) O(mc_cuda, obj_off) O(mc_cuda, result) O(mc_cuda, version) O(mc_cuda, device)
	O(mc_batch, count) O(mc_batch, source) O(mc_batch, id) O(mc_batch, entries) O(mc_batch, keys)
	O(mc_key, source) O(mc_key, key_len) O(mc_key, meta_len) O(mc_key, id) O(mc_key, addr) O(mc_key, len) O(mc_key, obj_off) O(mc_key, result) O(mc_key, version) O(mc_key, size) O(mc_key, gpu) O(mc_key, meta) O(mc_key, key)
	O(mc_gpu_ref, handle) O(mc_gpu_ref, device) O(mc_seg, id) O(mc_seg, off) O(mc_seg, len)
	O(mc_vbatch_entry, key_off) O(mc_vbatch_entry, key_len) O(mc_vbatch_entry, flags) O(mc_vbatch_entry, seg_off) O(mc_vbatch_entry, nseg) O(mc_vbatch_entry, meta_off) O(mc_vbatch_entry, meta_len) O(mc_vbatch_entry, obj_off) O(mc_vbatch_entry, result) O(mc_vbatch_entry, version)
	O(mc_vbatch, count) O(mc_vbatch, ngpu) O(mc_vbatch, entries) O(mc_vbatch, gpus) O(mc_vbatch, area)
	O(mc_table, count) O(mc_table, source) O(mc_table, id) O(mc_table, entries) O(mc_table, keys) O(mc_table, keys_len) O(mc_table, pad)
	C(MC_IOC_GET_MAGIC) C(MC_IOC_GET_ABI_VERSION) C(MC_IOC_REGISTER_BUFFER) C(MC_IOC_UNREGISTER_BUFFER)
	C(MC_IOC_PUT_BUF) C(MC_IOC_GET_BUF) C(MC_IOC_PUT_VM) C(MC_IOC_GET_VM) C(MC_IOC_STAT) C(MC_IOC_BATCH_PUT) C(MC_IOC_BATCH_GET) C(MC_IOC_PUT_CUDA) C(MC_IOC_GET_CUDA) C(MC_IOC_PUT_KEY) C(MC_IOC_GET_KEY) C(MC_IOC_BATCH_PUTV) C(MC_IOC_BATCH_GETV) C(MC_IOC_BATCH_WAIT) C(MC_IOC_BATCH_PUT_TABLE) C(MC_IOC_BATCH_GET_TABLE) C(MC_IOC_PUT_KEY_INLINE) C(MC_IOC_GET_KEY_INLINE)
	printf("const MC_MAX_META %d\nconst MC_MAX_GPU_REFS %d\nconst MC_MAX_SEGS %d\nconst MC_KIND_VM %u\nconst MC_SRC_CUDA %u\nconst MC_SEG_GPU %llu\n", MC_MAX_META, MC_MAX_GPU_REFS, MC_MAX_SEGS, MC_KIND_VM, MC_SRC_CUDA, MC_SEG_GPU);
	printf("const MC_MAX_BATCH %d\nconst MC_ABI_MINOR %d\nconst MC_ABI_MAJOR %d\n", MC_MAX_BATCH, MC_ABI_MINOR, MC_ABI_MAJOR);
	printf("const MC_FLAG_EXCL %u\nconst MC_FLAG_UPDATE %u\nconst MC_FLAG_PARENTS %u\nconst MC_REGISTER_DMABUF %u\n", MC_FLAG_EXCL, MC_FLAG_UPDATE, MC_FLAG_PARENTS, MC_REGISTER_DMABUF);
	printf("const MC_FLAG_WHOLE %u\nconst MC_VBATCH_ASYNC %u\nconst MC_MAX_ASYNC_CALLS %d\n", MC_FLAG_WHOLE, MC_VBATCH_ASYNC, MC_MAX_ASYNC_CALLS);
	printf("const MC_MAX_TABLE %d\nconst MC_MAX_TABLE_KEY_BYTES %d\n", MC_MAX_TABLE, MC_MAX_TABLE_KEY_BYTES);
	printf("const MC_MAGIC %llu\n", (unsigned long long)MC_MAGIC);
	printf("const MC_SRC_INLINE %u\nconst MC_INLINE_BYTES %d\n", MC_SRC_INLINE, MC_INLINE_BYTES);
	return 0;
}
`
	wd, _ := os.Getwd()
	if err := os.WriteFile(filepath.Join(dir, "h.c"), []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "h")
	if out, err := exec.Command(cc, "-Wall", "-Werror", "-I", wd, "-o", bin, filepath.Join(dir, "h.c")).CombinedOutput(); err != nil {
		t.Fatalf("compile: %v\n%s", err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]uint64{
		"sizeof mc_magic": SizeMagicArg, "sizeof mc_abi_version": SizeABIVersionArg,
		"sizeof mc_register": SizeRegisterArg, "sizeof mc_unregister": SizeUnregisterArg,
		"sizeof mc_buf": SizeBufArg, "sizeof mc_vm": SizeVMArg, "sizeof mc_stat": SizeStatArg,
		"sizeof mc_batch_entry": SizeBatchEntry, "sizeof mc_batch": SizeBatchArg, "sizeof mc_cuda": SizeCUDAArg,
		"sizeof mc_key": SizeKeyArg, "sizeof mc_gpu_ref": SizeGPURef, "sizeof mc_seg": SizeSeg,
		"sizeof mc_vbatch_entry": SizeVBatchEntry, "sizeof mc_vbatch": SizeVBatchArg,
		"cmd MC_IOC_PUT_KEY": uint64(CmdPutKey), "cmd MC_IOC_GET_KEY": uint64(CmdGetKey),
		"cmd MC_IOC_BATCH_PUTV": uint64(CmdBatchPutV), "cmd MC_IOC_BATCH_GETV": uint64(CmdBatchGetV),
		"cmd MC_IOC_BATCH_WAIT": uint64(CmdBatchWait), "const MC_VBATCH_ASYNC": uint64(VBatchAsync),
		"const MC_MAX_ASYNC_CALLS": MaxAsyncCalls,
		"sizeof mc_table":          SizeTableArg, "cmd MC_IOC_BATCH_PUT_TABLE": uint64(CmdBatchPutTable), "cmd MC_IOC_BATCH_GET_TABLE": uint64(CmdBatchGetTable),
		"const MC_MAX_TABLE": MaxTable, "const MC_MAX_TABLE_KEY_BYTES": MaxTableKeyBytes,
		"const MC_MAX_META": MaxMeta, "const MC_MAX_GPU_REFS": MaxGPURefs, "const MC_MAX_SEGS": MaxSegs,
		"const MC_KIND_VM": uint64(KindVM), "const MC_SRC_CUDA": uint64(SrcCUDA), "const MC_SEG_GPU": SegGPU,
		"cmd MC_IOC_PUT_CUDA": uint64(CmdPutCUDA), "cmd MC_IOC_GET_CUDA": uint64(CmdGetCUDA),
		"cmd MC_IOC_GET_MAGIC": uint64(CmdGetMagic), "cmd MC_IOC_GET_ABI_VERSION": uint64(CmdGetABIVersion),
		"cmd MC_IOC_REGISTER_BUFFER": uint64(CmdRegisterBuffer), "cmd MC_IOC_UNREGISTER_BUFFER": uint64(CmdUnregisterBuffer),
		"cmd MC_IOC_PUT_BUF": uint64(CmdPutBuf), "cmd MC_IOC_GET_BUF": uint64(CmdGetBuf),
		"cmd MC_IOC_PUT_VM": uint64(CmdPutVM), "cmd MC_IOC_GET_VM": uint64(CmdGetVM),
		"cmd MC_IOC_STAT": uint64(CmdStat), "cmd MC_IOC_BATCH_PUT": uint64(CmdBatchPut), "cmd MC_IOC_BATCH_GET": uint64(CmdBatchGet),
		"const MC_MAX_BATCH": MaxBatch, "const MC_ABI_MINOR": ABIMinor, "const MC_ABI_MAJOR": ABIMajor,
		"const MC_MAGIC":     MagicValue,
		"const MC_FLAG_EXCL": uint64(FlagExcl), "const MC_FLAG_UPDATE": uint64(FlagUpdate), "const MC_FLAG_PARENTS": uint64(FlagParents),
		"const MC_FLAG_WHOLE":      uint64(FlagWhole),
		"const MC_REGISTER_DMABUF": uint64(RegisterDmabuf),
		"sizeof mc_key_inline":     SizeKeyInlineArg, "cmd MC_IOC_PUT_KEY_INLINE": uint64(CmdPutKeyInline), "cmd MC_IOC_GET_KEY_INLINE": uint64(CmdGetKeyInline),
		"const MC_SRC_INLINE": uint64(SrcInline), "const MC_INLINE_BYTES": InlineBytes,
	}
	for name, off := range fieldOffsets {
		want["offsetof "+name] = off
	}
	seen := map[string]bool{}
	for line := range strings.SplitSeq(strings.TrimSpace(string(out)), "\n") {
		i := strings.LastIndexByte(line, ' ')
		name, v := line[:i], line[i+1:]
		got, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("bad line %q", line)
		}
		w, ok := want[name]
		if !ok {
			t.Errorf("C prints %q, which the test does not know", name)
			continue
		}
		seen[name] = true
		if got != w {
			t.Errorf("%s: C says %d, Go says %d", name, got, w)
		}
	}
	for name := range want {
		if !seen[name] {
			t.Errorf("%s not checked in C", name)
		}
	}
}

// fieldOffsets are the wire offsets the Go encoders use (see data.go).
var fieldOffsets = map[string]uint64{
	"mc_register.fd": 8, "mc_register.kind": 12, "mc_register.len": 16, "mc_register.offset": 24, "mc_register.id": 32, "mc_register.handle": 40,
	"mc_buf.id": 8, "mc_buf.buf_off": 16, "mc_buf.len": 24, "mc_buf.obj_off": 32, "mc_buf.result": 40, "mc_buf.version": 48,
	"mc_vm.addr": 8, "mc_vm.len": 16, "mc_vm.obj_off": 24, "mc_vm.result": 32, "mc_vm.version": 40,
	"mc_stat.size": 8, "mc_stat.version": 16, "mc_stat.ino": 24, "mc_stat.mtime_ns": 32, "mc_stat.mode": 40, "mc_stat.pinned": 44,
	"mc_stat.replicas": 48, "mc_stat.extents": 52, "mc_stat.location": 56,
	"mc_batch_entry.key_off": 0, "mc_batch_entry.key_len": 2, "mc_batch_entry.flags": 4, "mc_batch_entry.addr": 8,
	"mc_batch_entry.len": 16, "mc_batch_entry.obj_off": 24, "mc_batch_entry.result": 32, "mc_batch_entry.version": 40,
	"mc_cuda.handle": 8, "mc_cuda.dev_off": 72, "mc_cuda.len": 80, "mc_cuda.obj_off": 88, "mc_cuda.result": 96,
	"mc_cuda.version": 104, "mc_cuda.device": 112,
	"mc_key.source": 8, "mc_key.key_len": 12, "mc_key.meta_len": 14, "mc_key.id": 16, "mc_key.addr": 24, "mc_key.len": 32,
	"mc_key.obj_off": 40, "mc_key.result": 48, "mc_key.version": 56, "mc_key.size": 64, "mc_key.gpu": 72, "mc_key.meta": 152,
	"mc_key.key": keyArgKeyOff, "mc_key_inline.k": 0, "mc_key_inline.data": SizeKeyArg,
	"mc_gpu_ref.handle": 0, "mc_gpu_ref.device": 64, "mc_seg.id": 0, "mc_seg.off": 8, "mc_seg.len": 16,
	"mc_vbatch_entry.key_off": 0, "mc_vbatch_entry.key_len": 2, "mc_vbatch_entry.flags": 4, "mc_vbatch_entry.seg_off": 8,
	"mc_vbatch_entry.nseg": 12, "mc_vbatch_entry.meta_off": 16, "mc_vbatch_entry.meta_len": 20, "mc_vbatch_entry.obj_off": 24,
	"mc_vbatch_entry.result": 32, "mc_vbatch_entry.version": 40,
	"mc_vbatch.count": 8, "mc_vbatch.ngpu": 12, "mc_vbatch.entries": 16, "mc_vbatch.gpus": 16 + MaxBatch*SizeVBatchEntry,
	"mc_vbatch.area": vbatchAreaOff,
	"mc_table.count": 8, "mc_table.source": 12, "mc_table.id": 16, "mc_table.entries": 24, "mc_table.keys": 32,
	"mc_table.keys_len": 40, "mc_table.pad": 44,
	"mc_batch.count": 8, "mc_batch.source": 12, "mc_batch.id": 16, "mc_batch.entries": 24, "mc_batch.keys": batchKeysOff,
}
