package main

// KV-cache cases on GPU memory. kv-{put,get}-gpu-SIZE move at least
// kvGPUBytes of blocks of SIZE between one CUDA allocation of the worker,
// registered once on the directory (MC_KIND_CUDA), and the store, 64 keys
// per call, as the issue that made them defines them (kvPass keys per
// client call, its table calls of ioctl.MaxBatch keys overlapping as
// bench_kv.go says): the daemon pipelines a call's chunks
// on its streams and merges copies of blocks that are neighbours on both
// sides.
// The ceiling, measured right after in the same process, is the same
// blocks copied with cuMemcpyAsync between the allocation and pinned host
// memory of the worker, one copy per block, one stream, one synchronize.
// kv-{put,get}-gpu-scattered-16KiB lay the blocks out on the GPU in a
// random order, so that nothing merges.
//
// kv-{put,get}-tensor-256KiB do the same with 64 separate torch tensors
// per batch_put_tensor / batch_get_tensor (python/bench/kv_bench.py):
// each tensor named by the IPC handle of its caching-allocator block, the
// timed pass after a first one that opened those handles. At --in-flight
// N > 1 the calls go with async_op, up to N in the daemon at once; at 1,
// one after the other, each done before the next is built.
// kv-{put,get}-mooncake-gpu-256KiB run vLLM's pattern through
// MooncakeDistributedStore (kv_bench.py --api mooncake): one GPU KV tensor
// registered once, 1024 blocks per batch_put_from_multi_buffers /
// batch_get_into_multi_buffers (as many as the direct path's client calls
// carry, each sent as ioctls of 64 keys, several at once). After the
// script, the same repetition runs kv-{put,get}-gpu-256KiB: its ceiling
// (cuMemcpyAsync of the same blocks) is theirs, and its rate is the
// mooncake cases' direct path (direct_ops_per_s, direct_ratio: their
// target is 0.9 of it).

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/cuda"
	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

const kvGPUBytes = 256 << 20

var kvGPUSizes = []uint64{16 << 10, 64 << 10, 256 << 10, 1 << 20}

func kvGPUCases() []benchCase {
	var cs []benchCase
	for _, size := range kvGPUSizes {
		label := fmt.Sprintf("%dKiB", size>>10)
		if size >= 1<<20 {
			label = fmt.Sprintf("%dMiB", size>>20)
		}
		for _, put := range []bool{true, false} {
			op := "get"
			if put {
				op = "put"
			}
			cs = append(cs, benchCase{name: "kv-" + op + "-gpu-" + label, target: withCopy, ceiling: "cuda-memcpy-async",
				small: true, needs: cuda.Init, run: kvGPURun(size, put, false)})
		}
	}
	// The same with the blocks in a random order on the GPU: no two keys
	// of a call are neighbours there, so no copies merge.
	for _, put := range []bool{true, false} {
		op := "get"
		if put {
			op = "put"
		}
		cs = append(cs, benchCase{name: "kv-" + op + "-gpu-scattered-16KiB", target: withCopy, ceiling: "cuda-memcpy-async",
			small: true, needs: cuda.Init, run: kvGPURun(16<<10, put, true)})
	}
	for _, op := range []string{"put", "get"} {
		cs = append(cs, benchCase{name: "kv-" + op + "-tensor-256KiB", target: withCopy, ceiling: "cuda-memcpy-async",
			small: true, needs: needTorchOnly, run: kvTensorRun(op, "tensor")})
	}
	// The vLLM connector's pattern through MooncakeDistributedStore: one
	// registered GPU KV tensor, 1024 blocks a call (its target: 0.9 of the
	// direct path, kv-*-gpu-256KiB).
	for _, op := range []string{"put", "get"} {
		cs = append(cs, benchCase{name: "kv-mooncake-" + op + "-gpu-256KiB", target: withCopy, ceiling: "cuda-memcpy-async",
			small: true, needs: needTorchOnly, run: kvTensorRun(op, "mooncake")})
	}
	return cs
}

func kvGPURun(size uint64, put, scatter bool) func(dir string, p benchParams) (benchSample, error) {
	return func(dir string, p benchParams) (benchSample, error) {
		defer func(keys int) { ioctl.BatchCallKeys = keys }(ioctl.BatchCallKeys)
		ioctl.BatchCallKeys = ioctl.MaxBatch
		keys := int(kvGPUBytes / size)
		total := uint64(keys) * size
		// at[k] is key k's block on the GPU.
		at := make([]uint64, keys)
		for k := range at {
			at[k] = uint64(k)
		}
		if scatter {
			rand.New(rand.NewPCG(uint64(p.Rep), 1)).Shuffle(keys, func(i, j int) { at[i], at[j] = at[j], at[i] })
		}
		g, err := newGPUBench(total)
		if err != nil {
			return benchSample{}, err
		}
		defer g.close()
		ctx, host, dev, h := g.ctx, g.host, g.dev, g.handle
		sub, d, err := openSmallDir(dir, "kv-gpu", p.Rep)
		if err != nil {
			return benchSample{}, err
		}
		defer d.Close()
		reg, err := d.RegisterCUDA(h, 0, total)
		if err != nil {
			return benchSample{}, err
		}
		names := smallNames(keys)
		pass := func(put bool) (time.Duration, error) {
			items := make([]ioctl.BatchItem, 0, kvPass)
			t0 := time.Now()
			for i := 0; i < keys; i += kvPass {
				items = items[:0]
				for k := i; k < min(i+kvPass, keys); k++ {
					items = append(items, ioctl.BatchItem{Key: names[k], BufOff: at[k] * size, Len: size})
				}
				var res []ioctl.BatchResult
				if put {
					res, err = d.BatchPutBuf(reg.ID, items)
				} else {
					res, err = d.BatchGetBuf(reg.ID, items)
				}
				if err != nil {
					return 0, err
				}
				for k, r := range res {
					if r.Err != nil {
						return 0, r.Err
					}
					if r.N != size {
						return 0, fmt.Errorf("%s: %d B, want %d", items[k].Key, r.N, size)
					}
				}
			}
			return time.Since(t0), nil
		}
		before, err := batchFigures(dir)
		if err != nil {
			return benchSample{}, err
		}
		_, copies0, err := gpuCopies(dir)
		if err != nil {
			return benchSample{}, err
		}
		elapsed, err := pass(true)
		if err == nil && !put {
			// Clear the GPU copy, read it back, check it.
			if err = ctx.CopyHtoD(dev, make([]byte, total)); err == nil {
				if before, err = batchFigures(dir); err == nil {
					_, copies0, err = gpuCopies(dir)
				}
				if err == nil {
					elapsed, err = pass(false)
				}
			}
		}
		if err != nil {
			return benchSample{}, err
		}
		after, err := batchFigures(dir)
		if err != nil {
			return benchSample{}, err
		}
		_, copies1, err := gpuCopies(dir)
		if err != nil {
			return benchSample{}, err
		}
		check := make([]byte, total)
		if err := ctx.CopyDtoH(check, dev); err != nil {
			return benchSample{}, err
		}
		if err := checkPattern("gpu blocks", check); err != nil {
			return benchSample{}, err
		}
		s := benchSample{Bytes: total, Ns: elapsed.Nanoseconds(), Ops: keys, KeyWorkNs: keyWork(before, after), KeyCPUNs: keyCPU(before, after), KeyWaits: keyWaits(before, after),
			TransferNs: transferWork(before, after), CopiesPerKey: float64(copies1-copies0) / float64(keys)}
		// The ceiling: the same blocks, async copies on one stream, one
		// synchronize, between the allocation and pinned host memory.
		st, err := ctx.NewStream()
		if err != nil {
			return benchSample{}, err
		}
		defer st.Close()
		t0 := time.Now()
		for k := range keys {
			blk := host[uint64(k)*size : uint64(k+1)*size]
			src := dev + cuda.DevicePtr(at[k]*size)
			if put {
				err = cuda.CopyDtoHAsync(blk, src, st)
			} else {
				err = cuda.CopyHtoDAsync(src, blk, st)
			}
			if err != nil {
				return benchSample{}, err
			}
		}
		if err := st.Sync(); err != nil {
			return benchSample{}, err
		}
		s.Ceiling = &benchSample{Bytes: total, Ns: time.Since(t0).Nanoseconds(), Ops: keys}
		if err := d.Unregister(reg.ID); err != nil {
			return benchSample{}, err
		}
		return s, removeSmall(sub, names)
	}
}

// gpuBench is what the GPU cases copy between: pinned host memory holding
// the pattern, and a GPU allocation of the same size holding it too.
type gpuBench struct {
	ctx    *cuda.Context
	host   []byte
	dev    cuda.DevicePtr
	handle [64]byte // the allocation's IPC handle
	undo   []func()
}

func newGPUBench(size uint64) (g *gpuBench, err error) {
	if err := cuda.Init(); err != nil {
		return nil, err
	}
	g = &gpuBench{}
	defer func() {
		if err != nil {
			g.close()
		}
	}()
	if g.ctx, err = cuda.Retain(0); err != nil {
		return nil, err
	}
	g.undo = append(g.undo, func() { g.ctx.Release() })
	if g.host, err = unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		return nil, err
	}
	g.undo = append(g.undo, func() { unix.Munmap(g.host) })
	for i := range g.host {
		g.host[i] = patternByte(i)
	}
	if err = g.ctx.HostRegister(g.host, cuda.HostRegisterPortable); err != nil {
		return nil, err
	}
	g.undo = append(g.undo, func() { g.ctx.HostUnregister(g.host) })
	if g.dev, err = g.ctx.MemAlloc(size); err != nil {
		return nil, err
	}
	g.undo = append(g.undo, func() { g.ctx.MemFree(g.dev) })
	if err = g.ctx.CopyHtoD(g.dev, g.host); err != nil {
		return nil, err
	}
	g.handle, err = g.ctx.IpcGetHandle(g.dev)
	return g, err
}

func (g *gpuBench) close() {
	for i := len(g.undo) - 1; i >= 0; i-- {
		g.undo[i]()
	}
	g.undo = nil
}

func needTorchOnly() error {
	if err := cuda.Init(); err != nil {
		return err
	}
	if _, err := benchScript("kv_bench.py"); err != nil {
		return err
	}
	out, err := exec.Command("python3", "-c", "import torch; assert torch.cuda.is_available()").CombinedOutput()
	if err != nil {
		return fmt.Errorf("python3 with torch and CUDA: %v: %s", err, out)
	}
	return nil
}

func kvTensorRun(op, api string) func(dir string, p benchParams) (benchSample, error) {
	return func(dir string, p benchParams) (benchSample, error) {
		script, err := benchScript("kv_bench.py")
		if err != nil {
			return benchSample{}, err
		}
		sub, err := smallDir(dir, "kv-"+api, p.Rep)
		if err != nil {
			return benchSample{}, err
		}
		out, err := exec.Command("python3", script, "--dir", sub, "--op", op, "--block", fmt.Sprint(256<<10),
			"--bytes", fmt.Sprint(kvGPUBytes), "--mount", dir, "--api", api, "--in-flight", fmt.Sprint(p.InFlight)).Output()
		if err != nil {
			if ee, ok := errors.AsType[*exec.ExitError](err); ok && len(ee.Stderr) > 0 {
				err = fmt.Errorf("%w: %s", err, ee.Stderr[max(0, len(ee.Stderr)-600):])
			}
			return benchSample{}, fmt.Errorf("kv_bench.py: %w", err)
		}
		var r struct {
			Bytes      uint64 `json:"bytes"`
			Keys       int    `json:"keys"`
			MooncakeNs int64  `json:"mooncake_ns"`
			// The daemon's, per key of the timed pass.
			KeyWorkNs int64 `json:"key_work_ns"`
			KeyCPUNs  int64 `json:"key_cpu_ns"`
			KeyWaits
			TransferNs   int64   `json:"transfer_ns"`
			CopiesPerKey float64 `json:"copies_per_key"`
			// The caller's own time per key, and its ioctls' beyond the
			// daemon's handler (tensor calls).
			ClientNs int64 `json:"client_ns"`
			FuseNs   int64 `json:"fuse_ns"`
		}
		if err := json.Unmarshal(out, &r); err != nil {
			return benchSample{}, fmt.Errorf("kv_bench.py said %q: %w", out, err)
		}
		if err := unix.Rmdir(sub); err != nil {
			return benchSample{}, err
		}
		s := benchSample{Bytes: r.Bytes, Ns: r.MooncakeNs, Ops: r.Keys, KeyWorkNs: r.KeyWorkNs, KeyCPUNs: r.KeyCPUNs, KeyWaits: r.KeyWaits, TransferNs: r.TransferNs, CopiesPerKey: r.CopiesPerKey,
			ClientNs: r.ClientNs, FuseNs: r.FuseNs}
		// The ceiling, and for the Mooncake API the direct path: the same
		// blocks through kv-*-gpu-256KiB, in this repetition.
		direct, err := kvGPURun(256<<10, op == "put", false)(dir, p)
		if err != nil {
			return benchSample{}, fmt.Errorf("the direct path: %w", err)
		}
		s.Ceiling = direct.Ceiling
		if api == "mooncake" {
			direct.Ceiling = nil
			s.Direct = &direct
		}
		return s, nil
	}
}
