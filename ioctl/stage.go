package ioctl

import (
	"math/bits"
	"runtime"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// Staging of one-key calls. PutKey and GetKey of a small value move it
// through a slot of memory this process shares with the daemon (one
// memfd for the whole process, mapped here and registered on each
// directory File that stages) instead of the caller's own memory: one
// memcpy here and one in the daemon, where process memory costs the
// daemon a process_vm_readv or process_vm_writev whose fixed cost
// (pinning the caller's page) is most of a small value's. On the 2-CPU
// dev VM (2026-12-05) a 4 KiB GET_KEY took 24-28 us at the median this
// way and 30-37 us from process memory, the bare round trip 17-18 us.
//
// What it takes: 1 MiB of shared memory per process, and on each of at
// most stageFiles Files at a time one registration (of its 1024) of
// 1 MiB (counted against the user's registered bytes). Other Files, and
// calls that find every slot taken, use process memory as before.
const (
	// StageMax is the largest value PutKey and GetKey stage; larger ones
	// go through process memory.
	StageMax = 64 << 10
	// stageSlots is how many one-key calls of the process stage at once.
	stageSlots = 16
	// stageFiles bounds the Files that hold a registration of the
	// staging memory at once.
	stageFiles = 8
)

// staging is the process's staging memory and its slots.
var staging struct {
	once sync.Once
	fd   int    // the memfd, kept open to register it on more Files
	mem  []byte // stageSlots slots of StageMax bytes; nil: no staging
	mu   sync.Mutex
	free uint32 // one bit per free slot
	// files counts the Files holding a registration of mem.
	files atomic.Int32
}

// setupStaging makes the staging memory, once per process; failures
// leave staging.mem nil (no staging).
func setupStaging() {
	size := stageSlots * StageMax
	fd, err := unix.MemfdCreate("mooncake-stage", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return
	}
	ok := false
	defer func() {
		if !ok {
			unix.Close(fd)
		}
	}()
	if unix.Ftruncate(fd, int64(size)) != nil {
		return
	}
	// A sealed size: the daemon's mappings never lose pages under them.
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
		return
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return
	}
	ok = true
	staging.fd, staging.mem, staging.free = fd, mem, 1<<stageSlots-1
}

// stage is a File's registration of the staging memory, made by its
// first call that can stage.
type stage struct {
	once sync.Once
	id   uint64      // the registration; valid when held is set
	held *stageToken // nil: this File does not stage
}

// stageToken is a File's claim on one of the stageFiles registrations:
// given back once, by Close or, for a File dropped without Close, by a
// cleanup when the collector frees it.
type stageToken struct{ done atomic.Bool }

func (t *stageToken) release() {
	if t.done.CompareAndSwap(false, true) {
		staging.files.Add(-1)
	}
}

// setup registers the staging memory on f when f is a directory and
// fewer than stageFiles Files hold it.
func (s *stage) setup(f *File) {
	staging.once.Do(setupStaging)
	if staging.mem == nil {
		return
	}
	if fi, err := f.f.Stat(); err != nil || !fi.IsDir() {
		return // one-key calls need a directory: theirs fail anyway
	}
	if staging.files.Add(1) > stageFiles {
		staging.files.Add(-1)
		return
	}
	reg, err := f.RegisterFd(staging.fd, 0, uint64(len(staging.mem)))
	if err != nil {
		staging.files.Add(-1)
		return
	}
	t := &stageToken{}
	runtime.AddCleanup(f, (*stageToken).release, t)
	s.id, s.held = reg.ID, t
}

// stageTake leases a slot for a one-key call on f of n bytes under key:
// the registration, the slot's number and its memory, or ok false when n
// is 0 or too large, the key one that KeyCall refuses, f does not stage,
// or every slot is taken.
func (f *File) stageTake(n int, key string) (id uint64, slot int, buf []byte, ok bool) {
	if n <= 0 || n > StageMax || len(key) == 0 || len(key) > KeyArgKeyBytes {
		// (A get of 0 bytes from process memory is a lookup.)
		return 0, 0, nil, false
	}
	s := &f.stage
	s.once.Do(func() { s.setup(f) })
	if s.held == nil {
		return 0, 0, nil, false
	}
	staging.mu.Lock()
	if staging.free == 0 {
		staging.mu.Unlock()
		return 0, 0, nil, false
	}
	slot = bits.TrailingZeros32(staging.free)
	staging.free &^= 1 << slot
	staging.mu.Unlock()
	at := slot * StageMax
	return s.id, slot, staging.mem[at : at+n : at+n], true
}

// stageGive returns slot.
func stageGive(slot int) {
	staging.mu.Lock()
	staging.free |= 1 << slot
	staging.mu.Unlock()
}

// stageClose is Close's part, before the descriptor closes: the
// registration goes now, not with the open file description (which
// dup'ed or inherited descriptors may keep open).
func (f *File) stageClose() {
	s := &f.stage
	s.once.Do(func() {}) // a File closed before staging never stages
	if s.held != nil && !s.held.done.Load() {
		_ = f.Unregister(s.id)
		s.held.release()
	}
}
