package main

// The cuda cases move one value between GPU memory of the worker and the
// store with PUT_CUDA / GET_CUDA: the daemon opens the allocation's IPC
// handle and the GPU copies straight between it and the pinned segments.
// The ceiling is the same copy between the same GPU memory and a pinned
// (cuMemHostRegister) host buffer of the worker, cuMemcpy in the same
// process right after. Cases: cuda-put-SIZE and cuda-get-SIZE for 64 MiB,
// 256 MiB and 1 GiB; they run only where CUDA is available.
//
// remote-cuda-put and remote-cuda-get move a 256 MiB value the same way
// in the cluster's directory of node A placed on node B (bench_cluster.go):
// GPU memory of the worker <-> A's bounce buffers <-> TCP <-> B's
// segments. Their ceiling is the remote cases' plain TCP stream of the
// same bytes.

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/mooncake-fs/mooncake-fs/cuda"
	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

func cudaBenchCases() []benchCase {
	var cs []benchCase
	for _, size := range []uint64{64 << 20, 256 << 20, 1 << 30} {
		for _, put := range []bool{true, false} {
			name := fmt.Sprintf("cuda-get-%s", sizeLabel(size))
			if put {
				name = fmt.Sprintf("cuda-put-%s", sizeLabel(size))
			}
			cs = append(cs, benchCase{name: name, target: withCopy, ceiling: "cuda-memcpy-pinned",
				needs: cuda.Init, run: benchCUDA(size, put)})
		}
	}
	for _, put := range []bool{true, false} {
		name := "remote-cuda-get"
		if put {
			name = "remote-cuda-put"
		}
		cs = append(cs, benchCase{name: name, target: withCopy, ceiling: "tcp-stream", cluster: benchRemoteDir,
			needs: func() error { return errors.Join(cuda.Init(), needEtcd()) }, run: benchRemoteCUDA(remoteCUDASize, put)})
	}
	cs = append(cs, kvGPUCases()...)
	return append(cs, safetensorsCases()...)
}

// remoteCUDASize: a few passes of replaced values fit node B's 2 GiB
// while retired bodies wait out the free delay.
const remoteCUDASize = 256 << 20

// benchRemoteCUDA is benchCUDA against a TCP ceiling.
func benchRemoteCUDA(size uint64, put bool) func(string, benchParams) (benchSample, error) {
	return benchCUDAWith(size, put, func(s benchSample, host []byte, _ func() error) (benchSample, error) {
		return withTCPCeiling(s, map[bool]string{true: "put", false: "get"}[put], host)
	})
}

func sizeLabel(n uint64) string {
	if n >= 1<<30 {
		return fmt.Sprintf("%dGiB", n>>30)
	}
	return fmt.Sprintf("%dMiB", n>>20)
}

// benchCUDA returns the run function of one cuda case.
func benchCUDA(size uint64, put bool) func(string, benchParams) (benchSample, error) {
	return benchCUDAWith(size, put, func(s benchSample, host []byte, memcpy func() error) (benchSample, error) {
		c, err := timeOps(s.Ops, uint64(len(host)), memcpy)
		if err != nil {
			return benchSample{}, err
		}
		s.Ceiling = &c
		return s, nil
	})
}

// benchCUDAWith times put_cuda or get_cuda of size bytes and attaches the
// ceiling that ceil measures; memcpy is the same copy between the GPU
// memory and the pinned host buffer host, which holds the value.
func benchCUDAWith(size uint64, put bool, ceil func(s benchSample, host []byte, memcpy func() error) (benchSample, error)) func(string, benchParams) (benchSample, error) {
	return func(dir string, p benchParams) (benchSample, error) {
		g, err := newGPUBench(size)
		if err != nil {
			return benchSample{}, err
		}
		defer g.close()
		ctx, host, dev, h := g.ctx, g.host, g.dev, g.handle
		path := filepath.Join(dir, "cuda-"+sizeLabel(size)+".dat")
		f, err := ioctl.Open(path, os.O_RDWR|os.O_CREATE)
		if err != nil {
			return benchSample{}, err
		}
		defer f.Close()
		m := ioctl.CUDAMem{Handle: h}
		doPut := func() error {
			got, _, err := f.PutCUDA(m, size, 0, 0)
			if err != nil {
				return err
			}
			return checkMoved("put_cuda", got, size)
		}
		n := int(max(2, p.Size/size))
		var s benchSample
		if put {
			if s, err = timeOps(n, size, doPut); err != nil {
				return benchSample{}, err
			}
		} else {
			if err := doPut(); err != nil {
				return benchSample{}, err
			}
			s, err = timeOps(n, size, func() error {
				got, _, err := f.GetCUDA(m, size, 0)
				if err != nil {
					return err
				}
				return checkMoved("get_cuda", got, size)
			})
			if err != nil {
				return benchSample{}, err
			}
		}
		// The value in the store and on the GPU must still be the pattern.
		clear(host[:1<<20])
		if err := ctx.CopyDtoH(host[:1<<20], dev); err != nil {
			return benchSample{}, err
		}
		if err := checkPattern("gpu after "+map[bool]string{true: "put", false: "get"}[put], host[:1<<20]); err != nil {
			return benchSample{}, err
		}
		b := make([]byte, 1<<20)
		if _, _, err := f.GetVM(b, 0); err != nil {
			return benchSample{}, err
		}
		if err := checkPattern("stored value", b); err != nil {
			return benchSample{}, err
		}
		// Ceiling: the same direction between the same GPU memory and
		// pinned host memory of this process, or what ceil measures.
		s, err = ceil(s, host, func() error {
			if put {
				return ctx.CopyDtoH(host, dev)
			}
			return ctx.CopyHtoD(dev, host)
		})
		if err != nil {
			return benchSample{}, err
		}
		return s, unlinkIfExists(path)
	}
}

// The safetensors cases put the same CUDA tensor through mooncake-fs
// (put_tensor / get_tensor of the Python client) and through safetensors
// on /dev/shm, the way users save GPU tensors today, in one Python worker
// (python/bench/tensor_bench.py). The "ceiling" is that comparison, not a
// limit: a ratio above 1 is faster than safetensors on /dev/shm.
func safetensorsCases() []benchCase {
	var cs []benchCase
	for _, op := range []string{"save", "load"} {
		cs = append(cs, benchCase{name: "safetensors-shm-" + op, target: withCopy, ceiling: "safetensors-shm-" + op,
			needs: needTorch, run: benchSafetensors(op)})
	}
	return cs
}

// tensorBenchScript finds python/bench/tensor_bench.py.
func tensorBenchScript() (string, error) { return benchScript("tensor_bench.py") }

// benchScript finds python/bench/NAME from the working directory or next
// to the binary's directory.
func benchScript(name string) (string, error) {
	cands := []string{filepath.Join("python", "bench", name)}
	if exe, err := os.Executable(); err == nil {
		cands = append(cands, filepath.Join(filepath.Dir(exe), "..", "python", "bench", name))
	}
	for _, c := range cands {
		if _, err := os.Stat(c); err == nil {
			return filepath.Abs(c)
		}
	}
	return "", fmt.Errorf("python/bench/%s not found (run from the repository root)", name)
}

func needTorch() error {
	if err := cuda.Init(); err != nil {
		return err
	}
	if _, err := tensorBenchScript(); err != nil {
		return err
	}
	out, err := exec.Command("python3", "-c", "import torch, safetensors; assert torch.cuda.is_available()").CombinedOutput()
	if err != nil {
		return fmt.Errorf("python3 with torch, safetensors and CUDA: %v: %s", err, out)
	}
	return nil
}

func benchSafetensors(op string) func(string, benchParams) (benchSample, error) {
	return func(dir string, p benchParams) (benchSample, error) {
		script, err := tensorBenchScript()
		if err != nil {
			return benchSample{}, err
		}
		size := min(p.Size, 1<<30)
		out, err := exec.Command("python3", script, "--dir", dir, "--op", op, "--size", fmt.Sprint(size)).Output()
		if err != nil {
			return benchSample{}, fmt.Errorf("tensor_bench.py: %w", err)
		}
		var r struct {
			Bytes      uint64 `json:"bytes"`
			MooncakeNs int64  `json:"mooncake_ns"`
			ShmNs      int64  `json:"shm_ns"`
		}
		if err := json.Unmarshal(out, &r); err != nil {
			return benchSample{}, fmt.Errorf("tensor_bench.py said %q: %w", out, err)
		}
		s := benchSample{Bytes: r.Bytes, Ns: r.MooncakeNs, Ops: 1}
		s.Ceiling = &benchSample{Bytes: r.Bytes, Ns: r.ShmNs, Ops: 1}
		return s, nil
	}
}
