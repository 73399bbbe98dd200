package transfer

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// vmPiece is one request against another process's memory.
type vmPiece struct {
	idx   int
	op    Op
	pid   int
	addr  uint64
	local []byte
}

// iovecs is vmCall's two lists, kept between calls (iovPool).
type iovecs struct {
	local  []unix.Iovec
	remote []unix.RemoteIovec
}

var iovPool = sync.Pool{New: func() any { return new(iovecs) }}

// release forgets the memory the lists named and returns iov to the pool.
func (iov *iovecs) release() {
	clear(iov.local)
	clear(iov.remote)
	iov.local, iov.remote = iov.local[:0], iov.remote[:0]
	iovPool.Put(iov)
}

// maxIov is the kernel's limit on iovecs per call (UIO_MAXIOV).
const maxIov = 1024

// vmHelpersPerWorker bounds the helper goroutines of all large copies of
// process memory at once, per worker.
const vmHelpersPerWorker = 4

// copyVM moves the pieces with process_vm_readv (writes into segments) and
// process_vm_writev (reads out of segments): the kernel copies straight
// between the other process's pages and the segment, once. Large batches
// are split into chunks that the calling goroutine copies with up to
// Workers-1 helpers of its own, never through the engine's shared
// workers: the other process's pages may be a mapping of a file of this
// mount (or of a file system that does not answer), whose fault waits on
// a request that itself needs the workers (a WRITE materializing a draft
// copies through them), so a call blocked on its own pages must not hold
// what other calls wait for. Helpers are taken only while the engine has
// some to spare (vmHelpersPerWorker per worker): calls stalled on their
// pages hold a bounded number, and a call that finds none copies alone,
// slower but without waiting.
func (e *Engine) copyVM(pieces []vmPiece, total uint64) []error {
	if total < e.opts.SplitBytes || e.opts.Workers < 2 {
		return vmGroups(pieces)
	}
	jobs := vmJobs(pieces, int(e.opts.ChunkBytes))
	var mu sync.Mutex
	var errs []error
	var next atomic.Int64
	copyJobs := func() {
		for {
			i := int(next.Add(1)) - 1
			if i >= len(jobs) {
				return
			}
			if es := vmGroups(jobs[i]); len(es) > 0 {
				mu.Lock()
				errs = append(errs, es...)
				mu.Unlock()
			}
		}
	}
	var wg sync.WaitGroup
	for range min(e.opts.Workers, len(jobs)) - 1 {
		if !e.takeVMHelper() {
			break
		}
		wg.Go(func() {
			defer e.vmHelpers.Add(-1)
			copyJobs()
		})
	}
	copyJobs()
	wg.Wait()
	return errs
}

// Stage copies len(dst) bytes at off of process memory b into dst, this
// process's own memory, and counts the copy: for a caller that writes b
// into memory others read under a lock, which it must not hold while b's
// pages fault (they may be a mapping that this daemon serves).
func (e *Engine) Stage(b Buffer, off uint64, dst []byte) error {
	if b.Kind != ProcessVM || off > b.Len || uint64(len(dst)) > b.Len-off {
		return fmt.Errorf("stage %d B at %d of a %v buffer of %d B: %w", len(dst), off, b.Kind, b.Size(), ErrBadRequest)
	}
	if len(dst) == 0 {
		return nil
	}
	err := errors.Join(e.copyVM([]vmPiece{{op: Write, pid: b.Pid, addr: b.Addr + off, local: dst}}, uint64(len(dst)))...)
	if err == nil {
		e.stats.copied.Add(uint64(len(dst)))
	}
	return err
}

// ReadProcess copies len(dst) bytes at addr of process pid into dst: a
// call's arguments that live in its caller's memory (a batch's entry
// table), not data, so not counted as bytes moved. ErrFault if any byte
// is not readable there, ErrNoProcess if pid is gone, the system call's
// errno otherwise (EPERM: not allowed to read that process).
func (e *Engine) ReadProcess(pid int, addr uint64, dst []byte) error {
	return errors.Join(vmGroups([]vmPiece{{op: Write, pid: pid, addr: addr, local: dst}})...)
}

// ReadProcessPair is ReadProcess of two ranges of process pid, with one
// system call when both are readable (a batch's table and its keys); it
// returns each range's error.
func (e *Engine) ReadProcessPair(pid int, addr0 uint64, dst0 []byte, addr1 uint64, dst1 []byte) (error, error) {
	ps := [2]vmPiece{{op: Write, pid: pid, addr: addr0, local: dst0}, {op: Write, pid: pid, addr: addr1, local: dst1}}
	if vmCall(ps[:]) == nil {
		return nil, nil
	}
	return vmCall(ps[:1]), vmCall(ps[1:])
}

// WriteProcess copies src to addr of process pid, as ReadProcess the
// other way.
func (e *Engine) WriteProcess(pid int, addr uint64, src []byte) error {
	return errors.Join(vmGroups([]vmPiece{{op: Read, pid: pid, addr: addr, local: src}})...)
}

// vmJobs cuts pieces into jobs of about cb bytes: a piece larger than cb
// in cb-sized parts, runs of smaller ones together (vmGroups copies each
// run with one system call, up to maxIov pieces).
func vmJobs(pieces []vmPiece, cb int) [][]vmPiece {
	var jobs [][]vmPiece
	var run []vmPiece
	var runBytes int
	flush := func() {
		if len(run) > 0 {
			jobs = append(jobs, run)
			run, runBytes = nil, 0
		}
	}
	for _, p := range pieces {
		if len(p.local) > cb {
			flush()
			for off := 0; off < len(p.local); off += cb {
				end := min(off+cb, len(p.local))
				jobs = append(jobs, []vmPiece{{idx: p.idx, op: p.op, pid: p.pid, addr: p.addr + uint64(off), local: p.local[off:end]}})
			}
			continue
		}
		if runBytes+len(p.local) > cb || len(run) == maxIov {
			flush()
		}
		run = append(run, p)
		runBytes += len(p.local)
	}
	flush()
	return jobs
}

// takeVMHelper takes one of the engine's helpers for a large copy of
// process memory, if one is left; never more than the bound are taken.
func (e *Engine) takeVMHelper() bool {
	limit := int64(vmHelpersPerWorker * e.opts.Workers)
	for {
		n := e.vmHelpers.Load()
		if n >= limit {
			return false
		}
		if e.vmHelpers.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// vmGroups issues one syscall per run of pieces with the same direction
// and process (up to maxIov each).
func vmGroups(ps []vmPiece) []error {
	var errs []error
	for len(ps) > 0 {
		n := 1
		for n < len(ps) && n < maxIov && ps[n].op == ps[0].op && ps[n].pid == ps[0].pid {
			n++
		}
		if err := vmCall(ps[:n]); err != nil {
			if n == 1 {
				errs = append(errs, err)
			} else {
				// One call for many requests failed: run them one by one,
				// so each failure is its own request's and the others
				// are done.
				for _, p := range ps[:n] {
					if err := vmCall([]vmPiece{p}); err != nil {
						errs = append(errs, err)
					}
				}
			}
		}
		ps = ps[n:]
	}
	return errs
}

func vmCall(ps []vmPiece) error {
	// The kernel reads both lists as byte streams: pieces that continue
	// the one before on either side extend its iovec there, so a run of
	// neighbouring values costs one page walk of the other process, not
	// one per value.
	iov := iovPool.Get().(*iovecs)
	local, remote := iov.local[:0], iov.remote[:0]
	defer func() {
		iov.local, iov.remote = local, remote // grown: kept for the next call
		iov.release()
	}()
	var want int
	var localEnd uintptr // where the last local iovec ends
	for _, p := range ps {
		n := len(p.local)
		if n == 0 {
			continue
		}
		start := uintptr(unsafe.Pointer(unsafe.SliceData(p.local)))
		if k := len(local) - 1; k >= 0 && localEnd == start {
			local[k].Len += uint64(n)
		} else {
			local = append(local, unix.Iovec{Base: &p.local[0]})
			local[len(local)-1].SetLen(n)
		}
		localEnd = start + uintptr(n)
		if k := len(remote) - 1; k >= 0 && remote[k].Base+uintptr(remote[k].Len) == uintptr(p.addr) {
			remote[k].Len += n
		} else {
			remote = append(remote, unix.RemoteIovec{Base: uintptr(p.addr), Len: n})
		}
		want += n
	}
	if want == 0 {
		return nil
	}
	var n int
	var err error
	if ps[0].op == Write {
		n, err = unix.ProcessVMReadv(ps[0].pid, local, remote, 0)
	} else {
		n, err = unix.ProcessVMWritev(ps[0].pid, local, remote, 0)
	}
	if err != nil {
		return reqError(ps[0].idx, fmt.Errorf("process %d at %#x: %w", ps[0].pid, ps[0].addr, vmErr(err)))
	}
	if n != want {
		return reqError(ps[0].idx, fmt.Errorf("process %d at %#x: %d of %d B: %w", ps[0].pid, ps[0].addr, n, want, ErrFault))
	}
	return nil
}

func vmErr(err error) error {
	switch err {
	case unix.EFAULT:
		return ErrFault
	case unix.ESRCH:
		return ErrNoProcess
	}
	return err
}
