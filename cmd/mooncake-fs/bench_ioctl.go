package main

// The ioctl cases measure the data-path ioctls through package ioctl, as a
// client program uses them.
//
//   - ioctl-put-buf, ioctl-get-buf: one 64 MiB value between a memfd
//     registered once and the store, with PUT_BUF/GET_BUF;
//   - ioctl-put-vm, ioctl-get-vm: the same from and into anonymous memory
//     of the worker, with PUT_VM/GET_VM (process_vm_readv/writev).
//
// Each is one copy per byte, so its ceiling is a single-threaded copy() of
// the same 64 MiB between the same kind of memory, measured right after in
// the same worker process (target withCopy). A repetition moves --size
// bytes (at least one value), each put replacing the whole object; one
// untimed call first faults in the daemon's side of the buffer and the
// extents, as any long-lived client would have.
//
//   - ioctl-small: --files times, a 4 KiB put and a get of it under a new
//     key, each one BATCH ioctl of one key on a directory (no open, no
//     lookup); the ceiling is creating, writing and closing a 4 KiB file
//     on tmpfs, then opening, reading and closing it.

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// ioctlValueSize is the value size of the large ioctl cases.
const ioctlValueSize = 64 << 20

func ioctlOps(p benchParams) int { return int(max(1, p.Size/ioctlValueSize)) }

// newBenchMemfd returns a memfd of n bytes, size sealed, mapped here and
// filled with the bench pattern.
func newBenchMemfd(n int) (*os.File, []byte, error) {
	fd, err := unix.MemfdCreate("mooncake-bench", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, nil, fmt.Errorf("memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "mooncake-bench")
	if err := unix.Ftruncate(fd, int64(n)); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("ftruncate memfd: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("seal memfd: %w", err)
	}
	mem, err := unix.Mmap(fd, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("mmap memfd: %w", err)
	}
	for i := range mem {
		mem[i] = patternByte(i)
	}
	return f, mem, nil
}

// timeOps runs op once untimed, then n times timed, each moving size
// bytes.
func timeOps(n int, size uint64, op func() error) (benchSample, error) {
	if err := op(); err != nil {
		return benchSample{}, err
	}
	t0 := time.Now()
	for range n {
		if err := op(); err != nil {
			return benchSample{}, err
		}
	}
	d := time.Since(t0)
	return benchSample{Bytes: uint64(n) * size, Ns: d.Nanoseconds(), Ops: n}, nil
}

// withCopyCeiling times n copies of src into dst and attaches them to s.
func withCopyCeiling(s benchSample, n int, dst, src []byte) (benchSample, error) {
	c, err := timeOps(n, uint64(len(src)), func() error { copy(dst, src); return nil })
	if err != nil {
		return benchSample{}, err
	}
	s.Ceiling = &c
	return s, nil
}

func checkMoved(op string, n, want uint64) error {
	if n != want {
		return fmt.Errorf("%s moved %d B, want %d", op, n, want)
	}
	return nil
}

// checkPattern verifies that b holds the bench pattern.
func checkPattern(what string, b []byte) error {
	for i := range b {
		if b[i] != patternByte(i) {
			return fmt.Errorf("%s: byte %d is %#x, want %#x", what, i, b[i], patternByte(i))
		}
	}
	return nil
}

func benchIoctlPutBuf(dir string, p benchParams) (benchSample, error) {
	return ioctlPutBuf(dir, p, func(s benchSample, mem []byte) (benchSample, error) {
		dst, err := newBenchBuf(ioctlValueSize)
		if err != nil {
			return benchSample{}, err
		}
		defer dst.free()
		return withCopyCeiling(s, s.Ops, dst, mem)
	})
}

// ioctlPutBuf times PUT_BUF of the 64 MiB value into dir, then lets
// ceiling attach its ceiling (it gets the source memory).
func ioctlPutBuf(dir string, p benchParams, ceiling func(s benchSample, mem []byte) (benchSample, error)) (benchSample, error) {
	path := filepath.Join(dir, "ioctl-put-buf.dat")
	s, err := withRegisteredValue(path, os.O_RDWR|os.O_CREATE, func(f *ioctl.File, reg ioctl.Registration, mem []byte) (benchSample, error) {
		s, err := timeOps(ioctlOps(p), ioctlValueSize, func() error {
			got, _, err := f.PutBuf(reg.ID, 0, ioctlValueSize, 0, 0)
			if err != nil {
				return err
			}
			return checkMoved("put_buf", got, ioctlValueSize)
		})
		if err != nil {
			return benchSample{}, err
		}
		if err := checkStored(f, path); err != nil {
			return benchSample{}, err
		}
		return ceiling(s, mem)
	})
	if err != nil {
		return benchSample{}, err
	}
	return s, unlinkIfExists(path)
}

// withRegisteredValue opens path with flags, registers a 64 MiB memfd
// holding the bench pattern on it and runs fn; everything is closed after.
func withRegisteredValue(path string, flags int, fn func(f *ioctl.File, reg ioctl.Registration, mem []byte) (benchSample, error)) (benchSample, error) {
	mf, mem, err := newBenchMemfd(ioctlValueSize)
	if err != nil {
		return benchSample{}, err
	}
	defer unix.Munmap(mem)
	defer mf.Close()
	f, err := ioctl.Open(path, flags)
	if err != nil {
		return benchSample{}, err
	}
	defer f.Close()
	reg, err := f.Register(mf, 0, ioctlValueSize)
	if err != nil {
		return benchSample{}, err
	}
	return fn(f, reg, mem)
}

func benchIoctlPutVM(dir string, p benchParams) (benchSample, error) {
	path := filepath.Join(dir, "ioctl-put-vm.dat")
	buf, err := newHugeBenchBuf(ioctlValueSize)
	if err != nil {
		return benchSample{}, err
	}
	defer buf.free()
	f, err := ioctl.Open(path, os.O_RDWR|os.O_CREATE)
	if err != nil {
		return benchSample{}, err
	}
	defer f.Close()
	n := ioctlOps(p)
	s, err := timeOps(n, ioctlValueSize, func() error {
		got, _, err := f.PutVM(buf, 0)
		if err != nil {
			return err
		}
		return checkMoved("put_vm", got, ioctlValueSize)
	})
	if err != nil {
		return benchSample{}, err
	}
	if err := checkStored(f, path); err != nil {
		return benchSample{}, err
	}
	dst, err := newBenchBuf(ioctlValueSize)
	if err != nil {
		return benchSample{}, err
	}
	defer dst.free()
	if s, err = withCopyCeiling(s, n, dst, buf); err != nil {
		return benchSample{}, err
	}
	return s, unlinkIfExists(path)
}

// checkStored reads back the first and last MiB of a put value (untimed).
func checkStored(f *ioctl.File, path string) error {
	b := make([]byte, 1<<20)
	for _, off := range []int{0, ioctlValueSize - len(b)} {
		n, _, err := f.GetVM(b, uint64(off))
		if err != nil {
			return err
		}
		if err := checkMoved("get_vm", n, uint64(len(b))); err != nil {
			return err
		}
		// The pattern's period (251) does not divide off: compare with
		// the pattern at off.
		for i := range b {
			if b[i] != patternByte(off+i) {
				return fmt.Errorf("%s: byte %d is %#x, want %#x", path, off+i, b[i], patternByte(off+i))
			}
		}
	}
	return nil
}

func ioctlGetPath(dir string) string { return filepath.Join(dir, "ioctl-get.dat") }

// benchIoctlGetSetup stores the value the get cases read.
func benchIoctlGetSetup(dir string, _ benchParams) error {
	buf, err := newBenchBuf(ioctlValueSize)
	if err != nil {
		return err
	}
	defer buf.free()
	f, err := ioctl.Open(ioctlGetPath(dir), os.O_RDWR|os.O_CREATE)
	if err != nil {
		return err
	}
	if _, _, err := f.PutVM(buf, 0); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func benchIoctlGetTeardown(dir string, _ benchParams) error {
	return unlinkIfExists(ioctlGetPath(dir))
}

func benchIoctlGetBuf(dir string, p benchParams) (benchSample, error) {
	return ioctlGetBuf(dir, p, func(s benchSample, mem []byte) (benchSample, error) {
		src, err := newBenchBuf(ioctlValueSize)
		if err != nil {
			return benchSample{}, err
		}
		defer src.free()
		return withCopyCeiling(s, s.Ops, mem, src)
	})
}

// ioctlGetBuf times GET_BUF of the value stored by benchIoctlGetSetup,
// then lets ceiling attach its ceiling (it gets the destination memory).
func ioctlGetBuf(dir string, p benchParams, ceiling func(s benchSample, mem []byte) (benchSample, error)) (benchSample, error) {
	return withRegisteredValue(ioctlGetPath(dir), os.O_RDONLY, func(f *ioctl.File, reg ioctl.Registration, mem []byte) (benchSample, error) {
		clear(mem)
		s, err := timeOps(ioctlOps(p), ioctlValueSize, func() error {
			got, _, err := f.GetBuf(reg.ID, 0, ioctlValueSize, 0, 0)
			if err != nil {
				return err
			}
			return checkMoved("get_buf", got, ioctlValueSize)
		})
		if err != nil {
			return benchSample{}, err
		}
		if err := checkPattern("get_buf", mem); err != nil {
			return benchSample{}, err
		}
		return ceiling(s, mem)
	})
}

func benchIoctlGetVM(dir string, p benchParams) (benchSample, error) {
	buf, err := newHugeBenchBuf(ioctlValueSize)
	if err != nil {
		return benchSample{}, err
	}
	defer buf.free()
	clear(buf)
	f, err := ioctl.Open(ioctlGetPath(dir), os.O_RDONLY)
	if err != nil {
		return benchSample{}, err
	}
	defer f.Close()
	n := ioctlOps(p)
	s, err := timeOps(n, ioctlValueSize, func() error {
		got, _, err := f.GetVM(buf, 0)
		if err != nil {
			return err
		}
		return checkMoved("get_vm", got, ioctlValueSize)
	})
	if err != nil {
		return benchSample{}, err
	}
	if err := checkPattern("get_vm", buf); err != nil {
		return benchSample{}, err
	}
	src, err := newBenchBuf(ioctlValueSize)
	if err != nil {
		return benchSample{}, err
	}
	defer src.free()
	return withCopyCeiling(s, n, buf, src)
}

// smallDir makes a fresh directory for one repetition of a small case.
// openSmallDir is smallDir, opened for batch and key calls.
func openSmallDir(dir, prefix string, rep int) (string, *ioctl.File, error) {
	sub, err := smallDir(dir, prefix, rep)
	if err != nil {
		return "", nil, err
	}
	d, err := ioctl.OpenDir(sub)
	return sub, d, err
}

func smallDir(dir, prefix string, rep int) (string, error) {
	sub := filepath.Join(dir, fmt.Sprintf("%s-%d", prefix, rep))
	if err := os.RemoveAll(sub); err != nil {
		return "", err
	}
	if err := unix.Mkdir(sub, 0o755); err != nil {
		return "", fmt.Errorf("mkdir %s: %w", sub, err)
	}
	return sub, nil
}

// removeSmall unlinks the files of a small case and its directory.
func removeSmall(sub string, names []string) error {
	for _, name := range names {
		if err := unlinkIfExists(filepath.Join(sub, name)); err != nil {
			return err
		}
	}
	if err := unix.Rmdir(sub); err != nil {
		return fmt.Errorf("rmdir %s: %w", sub, err)
	}
	return nil
}

func smallNames(n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("f%07d", i)
	}
	return names
}

// benchIoctlSmall puts a 4 KiB value under each of p.Files new keys and
// gets it back, one BATCH_PUT and one BATCH_GET of one key each, timing
// every pair.
func benchIoctlSmall(dir string, p benchParams) (benchSample, error) {
	sub, err := smallDir(dir, "ioctl-small", p.Rep)
	if err != nil {
		return benchSample{}, err
	}
	wbuf, err := newBenchBuf(max(p.FileSize, 1))
	if err != nil {
		return benchSample{}, err
	}
	defer wbuf.free()
	rbuf, err := newBenchBuf(max(p.FileSize, 1))
	if err != nil {
		return benchSample{}, err
	}
	defer rbuf.free()
	d, err := ioctl.OpenDir(sub)
	if err != nil {
		return benchSample{}, err
	}
	defer d.Close()
	names := smallNames(p.Files)
	put := []ioctl.BatchItem{{Data: wbuf[:p.FileSize]}}
	get := []ioctl.BatchItem{{Data: rbuf[:p.FileSize]}}
	lat := make([]int64, p.Files)
	t0 := time.Now()
	for i, name := range names {
		s := time.Now()
		put[0].Key, get[0].Key = name, name
		r, err := d.BatchPut(put)
		if err == nil {
			err = r[0].Err
		}
		if err != nil {
			return benchSample{}, err
		}
		if r, err = d.BatchGet(get); err == nil {
			err = r[0].Err
		}
		if err != nil {
			return benchSample{}, err
		}
		if r[0].N != p.FileSize {
			return benchSample{}, fmt.Errorf("get %s: %d B, want %d", name, r[0].N, p.FileSize)
		}
		lat[i] = time.Since(s).Nanoseconds()
	}
	elapsed := time.Since(t0)
	if !bytes.Equal(rbuf[:p.FileSize], wbuf[:p.FileSize]) {
		return benchSample{}, fmt.Errorf("get: the last value read back differs")
	}
	if err := removeSmall(sub, names); err != nil {
		return benchSample{}, err
	}
	p50, p99 := percentiles(lat)
	return benchSample{Bytes: 2 * uint64(p.Files) * p.FileSize, Ns: elapsed.Nanoseconds(), Ops: p.Files, P50ns: p50, P99ns: p99}, nil
}

// benchTmpfsSmallPutGet is ioctl-small's ceiling on tmpfs: for each new
// file, create, write 4 KiB and close it, then open, read and close it.
func benchTmpfsSmallPutGet(dir string, p benchParams) (benchSample, error) {
	sub, err := smallDir(dir, "small-put-get", p.Rep)
	if err != nil {
		return benchSample{}, err
	}
	wbuf, err := newBenchBuf(max(p.FileSize, 1))
	if err != nil {
		return benchSample{}, err
	}
	defer wbuf.free()
	rbuf, err := newBenchBuf(max(p.FileSize, 1))
	if err != nil {
		return benchSample{}, err
	}
	defer rbuf.free()
	names := smallNames(p.Files)
	paths := make([]string, len(names))
	for i, n := range names {
		paths[i] = filepath.Join(sub, n)
	}
	lat := make([]int64, p.Files)
	t0 := time.Now()
	for i, path := range paths {
		s := time.Now()
		fd, err := openRetry(path, unix.O_CREAT|unix.O_TRUNC|unix.O_WRONLY, 0o644)
		if err != nil {
			return benchSample{}, fmt.Errorf("create %s: %w", path, err)
		}
		if err := writeFull(fd, wbuf[:p.FileSize]); err != nil {
			unix.Close(fd)
			return benchSample{}, fmt.Errorf("write %s: %w", path, err)
		}
		if err := unix.Close(fd); err != nil {
			return benchSample{}, fmt.Errorf("close %s: %w", path, err)
		}
		if fd, err = openRetry(path, unix.O_RDONLY, 0); err != nil {
			return benchSample{}, fmt.Errorf("open %s: %w", path, err)
		}
		n, err := unix.Read(fd, rbuf[:p.FileSize])
		unix.Close(fd)
		if err != nil || uint64(n) != p.FileSize {
			return benchSample{}, fmt.Errorf("read %s: %d B, %v", path, n, err)
		}
		lat[i] = time.Since(s).Nanoseconds()
	}
	elapsed := time.Since(t0)
	if err := removeSmall(sub, names); err != nil {
		return benchSample{}, err
	}
	p50, p99 := percentiles(lat)
	return benchSample{Bytes: 2 * uint64(p.Files) * p.FileSize, Ns: elapsed.Nanoseconds(), Ops: p.Files, P50ns: p50, P99ns: p99}, nil
}

// newHugeBenchBuf is newBenchBuf backed by transparent huge pages where the
// kernel has them: process_vm_readv/writev pin the caller's pages one
// folio at a time, so 2 MiB folios cost a 512th of the page walks.
func newHugeBenchBuf(n uint64) (benchBuf, error) {
	b, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("mmap %d B: %w", n, err)
	}
	_ = unix.Madvise(b, unix.MADV_HUGEPAGE) // advice: without THP it is an ordinary buffer
	for i := range b {
		b[i] = patternByte(i)
	}
	return b, nil
}
