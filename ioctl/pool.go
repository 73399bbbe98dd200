package ioctl

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Errors of the pool.
var (
	// ErrPoolExhausted: every slot is leased and the policy (or the
	// deadline) says not to wait longer.
	ErrPoolExhausted = errors.New("ioctl: pool exhausted")
	// ErrPoolClosed: the pool is closed.
	ErrPoolClosed = errors.New("ioctl: pool closed")
	// ErrPoolBusy: Close while leases are out.
	ErrPoolBusy = errors.New("ioctl: pool has leases out")
	// ErrDoubleReturn: a lease returned twice. In builds with -tags
	// invariants it panics instead.
	ErrDoubleReturn = errors.New("ioctl: lease returned twice")
)

// Exhausted says what Lease does when every slot is leased.
type Exhausted int

const (
	// FailWhenExhausted: Lease fails at once with ErrPoolExhausted.
	FailWhenExhausted Exhausted = iota
	// WaitWhenExhausted: Lease waits for a Return until its context is
	// done or PoolOptions.MaxWait has passed, then fails with an error
	// wrapping both ErrPoolExhausted and the context's error.
	WaitWhenExhausted
)

func (e Exhausted) String() string {
	switch e {
	case FailWhenExhausted:
		return "fail"
	case WaitWhenExhausted:
		return "wait"
	}
	return fmt.Sprintf("Exhausted(%d)", int(e))
}

// PoolOptions configure NewPool. The zero value fails fast when the pool
// is exhausted.
type PoolOptions struct {
	// Exhausted is the policy when every slot is leased. Zero:
	// FailWhenExhausted. A pool never registers more memory to serve a
	// Lease.
	Exhausted Exhausted
	// MaxWait bounds each waiting Lease (WaitWhenExhausted only), on top of
	// the Lease context's own deadline. Zero: only the context bounds it.
	MaxWait time.Duration
}

// DefaultPoolOptions waits up to 10 s for a slot.
func DefaultPoolOptions() PoolOptions {
	return PoolOptions{Exhausted: WaitWhenExhausted, MaxWait: 10 * time.Second}
}

// Validate reports every bad field.
func (o PoolOptions) Validate() error {
	var errs []error
	if o.Exhausted != FailWhenExhausted && o.Exhausted != WaitWhenExhausted {
		errs = append(errs, fmt.Errorf("ioctl: pool: Exhausted %v: want fail or wait", o.Exhausted))
	}
	if o.MaxWait < 0 {
		errs = append(errs, fmt.Errorf("ioctl: pool: MaxWait %v is negative", o.MaxWait))
	}
	if o.MaxWait > 0 && o.Exhausted != WaitWhenExhausted {
		errs = append(errs, fmt.Errorf("ioctl: pool: MaxWait %v needs Exhausted = wait", o.MaxWait))
	}
	return errors.Join(errs...)
}

// slots hands out count numbered slots and takes them back: the
// bookkeeping of a pool, without its memory. A free slot's number sits in
// the free channel; a leased one carries the generation its lease was
// made with, so a second Return of the same lease is caught even after the
// slot was leased again.
type slots struct {
	free chan int
	done chan struct{} // closed by close
	mu   struct {
		sync.Mutex
		leased []bool
		gen    []uint64
		out    int
		closed bool
		stats  PoolStats
	}
}

func newSlots(n int) *slots {
	s := &slots{free: make(chan int, n), done: make(chan struct{})}
	s.mu.leased = make([]bool, n)
	s.mu.gen = make([]uint64, n)
	s.mu.stats.Slots = n
	for i := range n {
		s.free <- i
	}
	return s
}

// take leases a slot, waiting as o says.
func (s *slots) take(ctx context.Context, o PoolOptions) (int, uint64, error) {
	select {
	case i := <-s.free:
		return s.mark(i, false)
	default:
	}
	if o.Exhausted != WaitWhenExhausted {
		s.count(func(st *PoolStats) { st.Exhausted++ })
		return 0, 0, fmt.Errorf("ioctl: pool: all %d slots leased: %w", cap(s.free), ErrPoolExhausted)
	}
	if o.MaxWait > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.MaxWait)
		defer cancel()
	}
	select {
	case i := <-s.free:
		return s.mark(i, true)
	case <-s.done:
		return 0, 0, ErrPoolClosed
	case <-ctx.Done():
		s.count(func(st *PoolStats) { st.Exhausted++ })
		return 0, 0, fmt.Errorf("ioctl: pool: all %d slots leased: %w: %w", cap(s.free), ErrPoolExhausted, ctx.Err())
	}
}

func (s *slots) count(f func(*PoolStats)) {
	s.mu.Lock()
	f(&s.mu.stats)
	s.mu.Unlock()
}

// mark records slot i, just taken from free, as leased.
func (s *slots) mark(i int, waited bool) (int, uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.closed {
		s.free <- i
		return 0, 0, ErrPoolClosed
	}
	s.mu.leased[i] = true
	s.mu.out++
	s.mu.stats.Leases++
	if waited {
		s.mu.stats.Waits++
	}
	return i, s.mu.gen[i], nil
}

// give returns slot i leased at generation gen.
func (s *slots) give(i int, gen uint64) error {
	s.mu.Lock()
	if i < 0 || i >= len(s.mu.leased) || !s.mu.leased[i] || s.mu.gen[i] != gen {
		s.mu.Unlock()
		err := fmt.Errorf("ioctl: pool: slot %d (generation %d): %w", i, gen, ErrDoubleReturn)
		if invariants {
			panic(err)
		}
		return err
	}
	s.mu.leased[i] = false
	s.mu.gen[i]++
	s.mu.out--
	s.mu.stats.Returns++
	s.mu.Unlock()
	s.free <- i // never blocks: i was taken from free
	return nil
}

// close refuses while leases are out; afterwards take fails.
func (s *slots) close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.closed {
		return ErrPoolClosed
	}
	if s.mu.out > 0 {
		return fmt.Errorf("ioctl: pool: close with %d of %d slots leased: %w", s.mu.out, cap(s.free), ErrPoolBusy)
	}
	s.mu.closed = true
	close(s.done)
	return nil
}

func (s *slots) stats() PoolStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.mu.stats
	st.Leased = s.mu.out
	return st
}

// PoolStats count what a pool did.
type PoolStats struct {
	Slots     int    // slots in the pool
	Leased    int    // slots leased now
	Leases    uint64 // successful Lease calls
	Returns   uint64
	Waits     uint64 // leases that had to wait for a Return
	Exhausted uint64 // Lease calls that failed for want of a slot
	// Registrations is REGISTER_BUFFER calls made: 1 for a live pool,
	// whatever it served.
	Registrations int
}

// Pool is registered memory cut into fixed-size slots: one memfd of
// count slots, mapped into this process and registered once, on one File.
// Lease hands out a slot and Return takes it back; what a lease's Buf
// holds moves to and from the store with one copy (PUT_BUF, GET_BUF, or a
// batch of the directory the pool was made on).
//
// A pool never registers more memory than it was made with: when every
// slot is leased, Lease fails or waits as PoolOptions say.
type Pool struct {
	f        *File
	opts     PoolOptions
	slotSize int
	stride   int
	mem      []byte
	reg      Registration
	slots    *slots

	closeOnce sync.Once
	closeErr  error
}

// NewPool maps count slots of slotSize bytes each (each slot starts on a
// page boundary) and registers them, once, on f: a regular file (its
// leases move its key's value) or a directory (keys relative to it,
// through batches). f must outlive the pool; closing f kills the
// registration.
func NewPool(f *File, slotSize, count int, o PoolOptions) (*Pool, error) {
	var errs []error
	if slotSize <= 0 {
		errs = append(errs, fmt.Errorf("ioctl: pool: slot size %d: want > 0", slotSize))
	}
	if count <= 0 {
		errs = append(errs, fmt.Errorf("ioctl: pool: count %d: want > 0", count))
	}
	if err := o.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	pg := os.Getpagesize()
	stride := (slotSize + pg - 1) &^ (pg - 1)
	size := stride * count
	if size/count != stride {
		return nil, fmt.Errorf("ioctl: pool: %d slots of %d B overflow", count, slotSize)
	}
	fd, err := unix.MemfdCreate("mooncake-pool", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("ioctl: pool: memfd_create: %w", err)
	}
	memf := os.NewFile(uintptr(fd), "mooncake-pool")
	// The daemon takes its own reference at REGISTER_BUFFER and the
	// mapping keeps ours: the descriptor is needed only until then.
	defer memf.Close()
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return nil, fmt.Errorf("ioctl: pool: ftruncate memfd to %d B: %w", size, err)
	}
	// Sealed size: the daemon's mapping can never lose pages under it.
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
		return nil, fmt.Errorf("ioctl: pool: seal memfd: %w", err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("ioctl: pool: mmap %d B: %w", size, err)
	}
	reg, err := f.Register(memf, 0, uint64(size))
	if err != nil {
		_ = unix.Munmap(mem)
		return nil, err
	}
	p := &Pool{f: f, opts: o, slotSize: slotSize, stride: stride, mem: mem, reg: reg, slots: newSlots(count)}
	p.slots.count(func(st *PoolStats) { st.Registrations = 1 })
	return p, nil
}

// ID is the pool's registration on its File.
func (p *Pool) ID() uint64 { return p.reg.ID }

// File is the file the pool is registered on.
func (p *Pool) File() *File { return p.f }

// SlotSize is the length of every lease's Buf.
func (p *Pool) SlotSize() int { return p.slotSize }

// Stats reports the pool's counters.
func (p *Pool) Stats() PoolStats { return p.slots.stats() }

// Lease hands out a free slot, or fails or waits as the pool's options
// say when none is free. The caller owns the lease until Return.
func (p *Pool) Lease(ctx context.Context) (*Lease, error) {
	i, gen, err := p.slots.take(ctx, p.opts)
	if err != nil {
		return nil, err
	}
	off := i * p.stride
	return &Lease{Buf: p.mem[off : off+p.slotSize : off+p.slotSize], Off: uint64(off), p: p, slot: i, gen: gen}, nil
}

// Close unregisters and unmaps the pool's memory. It fails with
// ErrPoolBusy, changing nothing, while leases are out: their Bufs would
// point at unmapped memory. The pool's File stays open.
func (p *Pool) Close() error {
	if err := p.slots.close(); err != nil && !errors.Is(err, ErrPoolClosed) {
		return err
	}
	p.closeOnce.Do(func() {
		uerr := p.f.Unregister(p.reg.ID)
		merr := unix.Munmap(p.mem)
		p.mem = nil
		if merr != nil {
			merr = fmt.Errorf("ioctl: pool: munmap: %w", merr)
		}
		p.closeErr = errors.Join(uerr, merr)
	})
	return p.closeErr
}

// Lease is one slot of a Pool, owned by the caller until Return.
type Lease struct {
	// Buf is the slot: SlotSize bytes of registered memory, valid until
	// Return. Views of it must not outlive the lease.
	Buf []byte
	// Off is Buf's offset in the pool's registration: the BufOff of
	// PUT_BUF, GET_BUF and batch entries.
	Off uint64

	p    *Pool
	slot int
	gen  uint64
}

// ID is the registration the lease belongs to.
func (l *Lease) ID() uint64 { return l.p.reg.ID }

// Return gives the slot back. A second Return of the same lease returns
// ErrDoubleReturn, or panics in builds with -tags invariants.
func (l *Lease) Return() error { return l.p.slots.give(l.slot, l.gen) }

// Put stores the first n bytes of Buf with one copy, as the whole value
// (flags as File.PutBuf): of the pool's file when key is "", else of key
// relative to the pool's directory. It returns the version written.
func (l *Lease) Put(key string, n int, flags uint32) (uint64, error) {
	if n < 0 || n > len(l.Buf) {
		return 0, fmt.Errorf("ioctl: lease put %d B: slot holds %d: %w", n, len(l.Buf), unix.EINVAL)
	}
	if key == "" {
		_, v, err := l.p.f.PutBuf(l.p.reg.ID, l.Off, uint64(n), 0, flags)
		return v, err
	}
	if len(key) <= KeyArgKeyBytes {
		// One key: PUT_KEY's argument is a sixteenth of a batch's.
		a := KeyArg{Header: Header{Flags: flags}, Source: SrcBuf, ID: l.p.reg.ID, Addr: l.Off, Len: uint64(n)}
		err := l.p.f.KeyCall(true, key, &a)
		return a.Version, err
	}
	r, err := l.p.f.BatchPutBuf(l.p.reg.ID, []BatchItem{{Key: key, Flags: flags, BufOff: l.Off, Len: uint64(n)}})
	if err != nil {
		return 0, err
	}
	return r[0].Version, r[0].Err
}

// Get reads up to len(Buf) bytes from objOff into Buf with one copy, from
// the pool's file when key is "", else from key relative to the pool's
// directory. It returns the count and the version read.
func (l *Lease) Get(key string, objOff uint64) (int, uint64, error) {
	if key == "" {
		n, v, err := l.p.f.GetBuf(l.p.reg.ID, l.Off, uint64(len(l.Buf)), objOff, 0)
		return int(n), v, err
	}
	if len(key) <= KeyArgKeyBytes && len(l.Buf) > 0 {
		a := KeyArg{Source: SrcBuf, ID: l.p.reg.ID, Addr: l.Off, Len: uint64(len(l.Buf)), ObjOff: objOff}
		err := l.p.f.KeyCall(false, key, &a)
		return int(a.Result), a.Version, err
	}
	r, err := l.p.f.BatchGetBuf(l.p.reg.ID, []BatchItem{{Key: key, ObjOff: objOff, BufOff: l.Off, Len: uint64(len(l.Buf))}})
	if err != nil {
		return 0, 0, err
	}
	return int(r[0].N), r[0].Version, r[0].Err
}
