package ioctl

import (
	"math/bits"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Staging of one-key calls. PutKey and GetKey of a small value move it
// through a slot of memory this process shares with the daemon (a memfd
// that both map, registered once per File) instead of the caller's own
// memory: one memcpy here and one in the daemon, where process memory
// costs the daemon a process_vm_readv or process_vm_writev, whose fixed
// cost (pinning the caller's pages) is most of a small value's. On the
// 2-CPU dev VM (2026-12-05) a 4 KiB PUT_KEY took 28-47 us at the median
// from process memory and 25-29 us from a registered slot, the bare round
// trip 17-18 us.
const (
	// StageMax is the largest value PutKey and GetKey stage; larger ones
	// go through process memory.
	StageMax = 64 << 10
	// stageSlots is how many one-key calls of one File stage at once;
	// more go through process memory.
	stageSlots = 4
)

// stage is a File's staging slots, made on the first call that can use
// them. If they cannot be made (no memfd, the daemon refuses the
// registration), the File's calls use process memory.
type stage struct {
	once sync.Once
	mu   sync.Mutex
	mem  []byte // stageSlots slots of StageMax bytes; nil: no staging
	id   uint64 // the registration of mem on the File
	free uint32 // one bit per free slot
	out  int    // slots leased
	done bool   // the File is closed: mem goes with the last slot
}

// setup maps and registers the slots on f; failures leave s.mem nil.
func (s *stage) setup(f *File) {
	size := stageSlots * StageMax
	fd, err := unix.MemfdCreate("mooncake-stage", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return
	}
	memf := os.NewFile(uintptr(fd), "mooncake-stage")
	defer memf.Close() // the daemon keeps its own reference, the mapping ours
	if unix.Ftruncate(fd, int64(size)) != nil {
		return
	}
	// A sealed size: the daemon's mapping never loses pages under it.
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
		return
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return
	}
	reg, err := f.Register(memf, 0, uint64(size))
	if err != nil {
		_ = unix.Munmap(mem)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done { // closed meanwhile: the registration died with it
		_ = unix.Munmap(mem)
		return
	}
	s.mem, s.id, s.free = mem, reg.ID, 1<<stageSlots-1
}

// stageTake leases a slot for a value of n bytes: its number and memory,
// or ok false when n is 0 or too large or every slot is leased (or there
// are none).
func (f *File) stageTake(n int) (slot int, buf []byte, ok bool) {
	if n <= 0 || n > StageMax {
		// (A get of 0 bytes from process memory is a lookup.)
		return 0, nil, false
	}
	s := &f.stage
	s.once.Do(func() { s.setup(f) })
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mem == nil || s.done || s.free == 0 {
		return 0, nil, false
	}
	slot = bits.TrailingZeros32(s.free)
	s.free &^= 1 << slot
	s.out++
	return slot, s.mem[slot*StageMax : slot*StageMax+n : slot*StageMax+n], true
}

// stageGive returns slot, unmapping the slots once the File is closed
// and none is leased.
func (f *File) stageGive(slot int) {
	s := &f.stage
	s.mu.Lock()
	defer s.mu.Unlock()
	s.free |= 1 << slot
	s.out--
	if s.done && s.out == 0 && s.mem != nil {
		_ = unix.Munmap(s.mem)
		s.mem = nil
	}
}

// stageClose is Close's part: the slots go now, or with the last leased.
func (f *File) stageClose() {
	s := &f.stage
	s.mu.Lock()
	defer s.mu.Unlock()
	s.done = true
	if s.out == 0 && s.mem != nil {
		_ = unix.Munmap(s.mem)
		s.mem = nil
	}
}
