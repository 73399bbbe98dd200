package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	mfs "github.com/mooncake-fs/mooncake-fs/fs"
	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// KV-cache cases on host memory: many small values per batch call, the
// way an inference engine saves and loads the blocks of its KV cache.
// kv-{put,get}-host-SIZE moves them from and into one registered buffer
// (the engine's pool); kv-{put,get}-host-vm-SIZE from and into plain
// process memory. Each pass puts --files new keys, kvPass keys per
// client call, which the client sends as table calls (ABI 1.8) of up to
// ioctl.BatchCallKeys keys, cut into ioctl.BatchInFlight calls at once
// where that is more than one (a get pass puts them first,
// untimed; a put from the registered buffer follows an untimed pass that
// has the daemon touch the buffer once, as an engine's reused pool is).
// The ceiling is the same values written as files to tmpfs and read
// back, one process.

const kvPass = 1024

var kvHostSizes = []uint64{4 << 10, 64 << 10}

func kvHostCases() []benchCase {
	var cs []benchCase
	for _, size := range kvHostSizes {
		label := fmt.Sprintf("%dKiB", size>>10)
		for _, vm := range []bool{false, true} {
			src := "host"
			if vm {
				src = "host-vm"
			}
			cs = append(cs,
				benchCase{name: "kv-put-" + src + "-" + label, target: onMount, ceiling: "tmpfs-files-write", small: true,
					run: kvHostRun(size, true, vm), ceilingRun: kvTmpfsRun(size, true)},
				benchCase{name: "kv-get-" + src + "-" + label, target: onMount, ceiling: "tmpfs-files-read", small: true,
					run: kvHostRun(size, false, vm), ceilingRun: kvTmpfsRun(size, false)})
		}
	}
	return cs
}

// kvSource is the memory a kv case moves values from or into: a memfd
// registered on the directory, or anonymous memory.
type kvSource struct {
	mem  []byte
	reg  ioctl.Registration
	file *os.File
}

func newKVSource(d *ioctl.File, n uint64, register bool) (*kvSource, error) {
	if !register {
		b, err := newBenchBuf(n)
		if err != nil {
			return nil, err
		}
		return &kvSource{mem: b}, nil
	}
	fd, err := unix.MemfdCreate("mooncake-bench-kv", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd: %w", err)
	}
	f := os.NewFile(uintptr(fd), "mooncake-bench-kv")
	if err := f.Truncate(int64(n)); err != nil {
		f.Close()
		return nil, err
	}
	mem, err := unix.Mmap(fd, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("mmap memfd: %w", err)
	}
	for i := range mem {
		mem[i] = patternByte(i)
	}
	s := &kvSource{mem: mem, file: f}
	if s.reg, err = d.Register(f, 0, n); err != nil {
		s.free(d)
		return nil, err
	}
	return s, nil
}

func (s *kvSource) free(d *ioctl.File) {
	if s.file != nil {
		if s.reg.ID != 0 {
			_ = d.Unregister(s.reg.ID)
		}
		_ = unix.Munmap(s.mem)
		s.file.Close()
		return
	}
	benchBuf(s.mem).free()
}

// batch runs one call on keys[i:j] at offset i*size of s.
func (s *kvSource) batch(d *ioctl.File, put bool, keys []string, i, j int, size uint64) error {
	items := make([]ioctl.BatchItem, 0, j-i)
	for k := i; k < j; k++ {
		it := ioctl.BatchItem{Key: keys[k]}
		off := uint64(k) * size
		if s.file != nil {
			it.BufOff, it.Len = off, size
		} else {
			it.Data = s.mem[off : off+size]
		}
		items = append(items, it)
	}
	var res []ioctl.BatchResult
	var err error
	switch {
	case put && s.file != nil:
		res, err = d.BatchPutBuf(s.reg.ID, items)
	case put:
		res, err = d.BatchPut(items)
	case s.file != nil:
		res, err = d.BatchGetBuf(s.reg.ID, items)
	default:
		res, err = d.BatchGet(items)
	}
	if err != nil {
		return err
	}
	for k, r := range res {
		if r.Err != nil {
			return r.Err
		}
		if r.N != size {
			return fmt.Errorf("%s: %d B, want %d", items[k].Key, r.N, size)
		}
	}
	return nil
}

func kvHostRun(size uint64, put, vm bool) func(dir string, p benchParams) (benchSample, error) {
	return func(dir string, p benchParams) (benchSample, error) {
		sub, d, err := openSmallDir(dir, "kv", p.Rep)
		if err != nil {
			return benchSample{}, err
		}
		defer d.Close()
		n := uint64(p.Files) * size
		src, err := newKVSource(d, n, !vm)
		if err != nil {
			return benchSample{}, err
		}
		defer src.free(d)
		keys := smallNames(p.Files)
		passOf := func(keys []string, put bool) (time.Duration, error) {
			t0 := time.Now()
			for i := 0; i < len(keys); i += kvPass {
				if err := src.batch(d, put, keys, i, min(i+kvPass, len(keys)), size); err != nil {
					return 0, err
				}
			}
			return time.Since(t0), nil
		}
		pass := func(put bool) (time.Duration, error) { return passOf(keys, put) }
		if put && !vm {
			// The daemon maps a registration's pages as it first touches
			// them. An engine registers its pool once and reuses it, and
			// the ceiling's writer copies from a buffer it has touched:
			// so the timed pass copies from memory the daemon has touched
			// too, after an untimed one under other names, removed. (A
			// get's timed pass follows its untimed put.)
			warm := make([]string, len(keys))
			for i, k := range keys {
				warm[i] = "w" + k
			}
			if _, err := passOf(warm, true); err != nil {
				return benchSample{}, fmt.Errorf("warm-up: %w", err)
			}
			for _, k := range warm {
				if err := unlinkIfExists(filepath.Join(sub, k)); err != nil {
					return benchSample{}, err
				}
			}
		}
		before, err := batchFigures(dir)
		if err != nil {
			return benchSample{}, err
		}
		elapsed, err := pass(true)
		if err == nil && !put {
			clear(src.mem)
			if before, err = batchFigures(dir); err == nil {
				if elapsed, err = pass(false); err == nil {
					err = checkPattern("get", src.mem)
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
		if err := removeSmall(sub, keys); err != nil {
			return benchSample{}, err
		}
		return benchSample{Bytes: n, Ns: elapsed.Nanoseconds(), Ops: p.Files, KeyWorkNs: keyWork(before, after),
			KeyCPUNs: keyCPU(before, after), KeyWaits: keyWaits(before, after), TransferNs: transferWork(before, after)}, nil
	}
}

// keyWork is the daemon's own work per key between two readings of its
// batch figures: handler time minus the transfers.
func keyWork(before, after mfs.BatchStats) int64 {
	keys := after.Keys - before.Keys
	if keys == 0 {
		return 0
	}
	work := int64(after.HandlerNs-before.HandlerNs) - int64(after.TransferNs-before.TransferNs)
	return max(work, 0) / int64(keys)
}

// KeyWaits is where a key's handler time went beyond its work, per key
// of a pass (mfs.BatchStats' LockWaitNs, SchedWaitNs, GCCPUNs), the
// daemon's page faults per key (MinorFaults), the share of a put key's
// work done after its copy (CommitNs) and submitted calls' waits to
// start (QueueNs).
type KeyWaits struct {
	LockNs   int64   `json:"key_lock_wait_ns,omitempty"`
	PollNs   int64   `json:"key_lock_poll_ns,omitempty"`
	SchedNs  int64   `json:"key_sched_wait_ns,omitempty"`
	GCNs     int64   `json:"key_gc_ns,omitempty"`
	Faults   float64 `json:"key_faults,omitempty"`
	CommitNs int64   `json:"key_commit_ns,omitempty"`
	// QueueNs is the submitted calls' waits to start (QueueNs), which
	// their work leaves out.
	QueueNs int64 `json:"key_queue_ns,omitempty"`
}

// keyWaits is KeyWaits between two readings of the batch figures.
func keyWaits(before, after mfs.BatchStats) KeyWaits {
	keys := int64(after.Keys - before.Keys)
	if keys <= 0 {
		return KeyWaits{}
	}
	per := func(a, b uint64) int64 { return max(int64(b-a), 0) / keys }
	return KeyWaits{LockNs: per(before.LockWaitNs, after.LockWaitNs), PollNs: per(before.LockPollNs, after.LockPollNs), SchedNs: per(before.SchedWaitNs, after.SchedWaitNs),
		GCNs: per(before.GCCPUNs, after.GCCPUNs), Faults: float64(after.MinorFaults-min(before.MinorFaults, after.MinorFaults)) / float64(keys),
		CommitNs: per(before.CommitNs, after.CommitNs), QueueNs: per(before.QueueNs, after.QueueNs)}
}

// keyCPU is the daemon's CPU time per key between two readings of its
// batch figures.
func keyCPU(before, after mfs.BatchStats) int64 {
	keys := after.Keys - before.Keys
	if keys == 0 {
		return 0
	}
	return int64(after.CPUNs-before.CPUNs) / int64(keys)
}

// transferWork is the batches' transfer time per key between two
// readings of the figures.
func transferWork(before, after mfs.BatchStats) int64 {
	keys := after.Keys - before.Keys
	if keys == 0 {
		return 0
	}
	return int64(after.TransferNs-before.TransferNs) / int64(keys)
}

// batchFigures reads the daemon's batch figures from its status.
func batchFigures(mnt string) (mfs.BatchStats, error) {
	b, err := readStatus(mnt)
	if err != nil {
		return mfs.BatchStats{}, err
	}
	var st Status
	if err := json.Unmarshal(b, &st); err != nil {
		return mfs.BatchStats{}, fmt.Errorf("status of %s: %w", mnt, err)
	}
	return st.Batches, nil
}

// gpuCopies reads the mount's GPU copy counters from its status.
func gpuCopies(mnt string) (pieces, copies uint64, err error) {
	b, err := readStatus(mnt)
	if err != nil {
		return 0, 0, err
	}
	var st Status
	if err := json.Unmarshal(b, &st); err != nil {
		return 0, 0, fmt.Errorf("status of %s: %w", mnt, err)
	}
	return st.Transfer.GPUPieces, st.Transfer.GPUCopies, nil
}

// kvTmpfsRun is the ceiling: the values as files, create-write-close each
// (put) or open-read-close each after writing them untimed (get).
func kvTmpfsRun(size uint64, put bool) func(dir string, p benchParams) (benchSample, error) {
	return func(dir string, p benchParams) (benchSample, error) {
		sub, err := smallDir(dir, "kv", p.Rep)
		if err != nil {
			return benchSample{}, err
		}
		buf, err := newBenchBuf(uint64(p.Files) * size)
		if err != nil {
			return benchSample{}, err
		}
		defer buf.free()
		keys := smallNames(p.Files)
		write := func() (time.Duration, error) {
			t0 := time.Now()
			for i, k := range keys {
				fd, err := openRetry(filepath.Join(sub, k), unix.O_CREAT|unix.O_TRUNC|unix.O_WRONLY, 0o644)
				if err != nil {
					return 0, err
				}
				err = writeFull(fd, buf[uint64(i)*size:uint64(i+1)*size])
				if cerr := unix.Close(fd); err == nil {
					err = cerr
				}
				if err != nil {
					return 0, err
				}
			}
			return time.Since(t0), nil
		}
		elapsed, err := write()
		if err == nil && !put {
			// Read back into a cleared buffer, checked after, as the
			// mount's get is.
			clear(buf)
			t0 := time.Now()
			for i, k := range keys {
				fd, oerr := openRetry(filepath.Join(sub, k), unix.O_RDONLY, 0)
				if oerr != nil {
					err = oerr
					break
				}
				got, rerr := unix.Read(fd, buf[uint64(i)*size:uint64(i+1)*size])
				unix.Close(fd)
				if rerr != nil || uint64(got) != size {
					err = fmt.Errorf("read %s: %d B, %v", k, got, rerr)
					break
				}
			}
			elapsed = time.Since(t0)
			if err == nil {
				err = checkPattern("tmpfs read", buf)
			}
		}
		if err != nil {
			return benchSample{}, err
		}
		if err := removeSmall(sub, keys); err != nil {
			return benchSample{}, err
		}
		return benchSample{Bytes: uint64(p.Files) * size, Ns: elapsed.Nanoseconds(), Ops: p.Files}, nil
	}
}
