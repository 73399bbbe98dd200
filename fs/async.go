package fs

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"sync"
	"syscall"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// errNoCall: BATCH_WAIT named a call that is not outstanding on the
// handle (never submitted, or waited for already).
var errNoCall = errors.New("no such submitted call")

// maxAsyncTotal bounds the submitted calls the whole mount holds, all
// handles and users together (each keeps its 16 KiB of arguments until
// it is waited for): the per-handle bound times Options.MaxOpen handles
// would be gigabytes. maxAsyncPerUser is one user's share of them
// (root's aside): a user who never waits, over many handles, cannot take
// every call of the mount and leave the others EBUSY.
const (
	maxAsyncTotal   = 1024
	maxAsyncPerUser = maxAsyncTotal / 4
)

// asyncTable is a directory handle's vector batches submitted with
// ioctl.VBatchAsync (ABI 1.7): each runs in its own goroutine and stays
// here, with its results, until BATCH_WAIT collects it. At most
// ioctl.MaxAsyncCalls a handle, and maxAsyncTotal a mount (maxAsyncPerUser
// a user), so callers that never wait hold a bounded amount of the
// daemon.
type asyncTable struct {
	mu     sync.Mutex
	last   uint32 // the number given last
	calls  map[uint32]*asyncCall
	closed bool        // the handle was released: results go unread
	counts *userCounts // the mount's (asyncHeld)
	// ctx is the context of the handle's calls, made with the first:
	// releasing the handle cancels it, stopping those still running at
	// their next key.
	ctx    context.Context
	cancel context.CancelFunc
	// beforeRun, when set (tests), runs first in each call's goroutine.
	beforeRun func()
}

// asyncCall is one submitted call.
type asyncCall struct {
	a       *ioctl.VBatchArg // the call; its results are filled once done
	uid     uint32           // whose it is (asyncCounts)
	done    chan struct{}    // closed when the call is over
	claimed bool             // a BATCH_WAIT is collecting it
}

// errAsyncVM: a submitted call named process memory. It is read and
// written by the submitting thread's id after the ioctl returned, when
// nothing keeps that id naming the same program (the thread may exit, or
// exec a program of another user): only memory the daemon holds itself
// (memfd registrations, CUDA allocations by IPC handle) may be submitted.
var errAsyncVM = errors.New("process memory in a submitted call (use a memfd registration or GPU memory)")

// add numbers c and keeps it, returning the context it runs in (the
// handle's, under parent), or fails with EBUSY when the handle holds as
// many calls as it may.
func (t *asyncTable) add(c *asyncCall, parent context.Context) (uint32, context.Context, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return 0, nil, syscall.EBADF
	}
	if len(t.calls) >= ioctl.MaxAsyncCalls {
		return 0, nil, fmt.Errorf("%d submitted calls not waited for: %w", len(t.calls), syscall.EBUSY)
	}
	if err := t.counts.take(c.uid); err != nil {
		return 0, nil, err
	}
	if t.calls == nil {
		t.calls = map[uint32]*asyncCall{}
	}
	if t.ctx == nil {
		t.ctx, t.cancel = context.WithCancel(parent)
	}
	for {
		t.last++
		if t.last > math.MaxInt32 {
			t.last = 1 // the number is the ioctl's value: positive
		}
		if t.calls[t.last] == nil {
			break
		}
	}
	t.calls[t.last] = c
	return t.last, t.ctx, nil
}

// dropLocked forgets call id, its arguments back to the pool.
func (t *asyncTable) dropLocked(id uint32, c *asyncCall) {
	delete(t.calls, id)
	vbatchArgs.Put(c.a)
	t.counts.put(c.uid)
}

// finish marks call id done; a released handle's results are dropped.
// The call is marked done under the lock: close drops the calls it sees
// done, so a call marked done outside it could be dropped by both (its
// arguments in the pool twice, the mount's count one short).
func (t *asyncTable) finish(id uint32, c *asyncCall) {
	t.mu.Lock()
	defer t.mu.Unlock()
	close(c.done)
	if t.closed && !c.claimed {
		t.dropLocked(id, c)
	}
}

// close drops the results of the calls that are over and stops those
// still running at their next key (their results, unread, are dropped
// when they end: finish). Nothing waits: a call's registrations and GPU
// mappings are its own until it ends.
func (t *asyncTable) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	if t.cancel != nil {
		t.cancel()
	}
	for id, c := range t.calls {
		select {
		case <-c.done:
			if !c.claimed {
				t.dropLocked(id, c)
			}
		default:
		}
	}
}

// wait serves BATCH_WAIT: in names the call by its Count; out gets the
// call's arguments with its results. Call 0 waits for every call
// submitted before and consumes none.
func (t *asyncTable) wait(in, out []byte) error {
	if len(in) < ioctl.SizeVBatchArg || len(out) < ioctl.SizeVBatchArg {
		return fmt.Errorf("%d B in, %d out: %w", len(in), len(out), errBadBatch)
	}
	size, flags := binary.LittleEndian.Uint32(in[0:]), binary.LittleEndian.Uint32(in[4:])
	id, rest := binary.LittleEndian.Uint32(in[8:]), binary.LittleEndian.Uint32(in[12:])
	if size != ioctl.SizeVBatchArg || flags != 0 || rest != 0 {
		return fmt.Errorf("size %d, flags %#x, word %#x: %w", size, flags, rest, errBadBatch)
	}
	if id == 0 {
		t.mu.Lock()
		dones := make([]chan struct{}, 0, len(t.calls))
		for _, c := range t.calls {
			dones = append(dones, c.done)
		}
		t.mu.Unlock()
		for _, d := range dones {
			<-d
		}
		clear(out[:ioctl.SizeVBatchArg])
		binary.LittleEndian.PutUint32(out[0:], ioctl.SizeVBatchArg)
		return nil
	}
	t.mu.Lock()
	c := t.calls[id]
	if c == nil || c.claimed {
		t.mu.Unlock()
		return fmt.Errorf("call %d: %w", id, errNoCall)
	}
	c.claimed = true
	t.mu.Unlock()
	<-c.done
	c.a.MarshalInto(out)
	t.mu.Lock()
	t.dropLocked(id, c)
	t.mu.Unlock()
	return nil
}

// submittable refuses a call to submit whose segments name process
// memory (its own, or registrations by address), and reads what the call
// needs of its caller now, while the caller is blocked in the request
// and its /proc entry names it: its groups (the permission checks) and
// its GPU table's allocations. The call itself, its entries decoded
// included, runs after the ioctl returned, when the thread may be gone
// or its id another's. An entry whose segments do not decode is left to
// fail alone then.
func submittable(f *FS, bc *batchCall, dh *dirHandle, a *ioctl.VBatchArg) error {
	var wire []ioctl.Seg
	for i := range int(a.Count) {
		var err error
		if wire, err = a.Segs(wire[:0], i); err != nil {
			continue
		}
		for _, w := range wire {
			switch kind := wireKind(w.ID); {
			case kind == segVM && w.Len > 0:
				return fmt.Errorf("entry %d: %w", i, errAsyncVM)
			case kind == segReg && dh.regs.byAddress(w.ID):
				return fmt.Errorf("entry %d: registration %d: %w", i, w.ID, errAsyncVM)
			}
		}
	}
	if len(bc.gpus) > 0 {
		bc.mapped, bc.mapErr = f.gpuMappings(bc.p, bc.gpus)
	}
	if bc.uid != 0 {
		bc.p.fixGroups() // root's checks need none
	}
	return nil
}

// callFrame sizes the stack a submitted call's goroutine is given first
// (growStack). A goroutine starts with 2 KiB, and a call's grew two or
// three times, deep in the store's code (a lock's polling, a map
// lookup), each growth copying and adjusting every frame above it:
// 11% of the calls' CPU outside their copies (64-key tensor puts, an
// H100 host, 2026-12-07). growStack grows it once, first, when there is
// almost nothing to copy: a frame of 8 KiB makes a stack of 16 KiB, the
// largest size the runtime keeps per processor, which a call's deepest
// path fits. (The frame must stay under the runtime's bound for stack
// variables, 128 KiB, or it moves to the heap and does nothing.)
const callFrame = 8 << 10

// growStack grows the calling goroutine's stack to hold callFrame more.
//
//go:noinline
func growStack() byte {
	var frame [callFrame]byte
	return lastByte(frame[:])
}

// lastByte keeps growStack's frame from being optimized away.
//
//go:noinline
func lastByte(b []byte) byte { return b[len(b)-1] }
