package fs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
	"github.com/mooncake-fs/mooncake-fs/pinned"
)

// Errors of buffer registration.
var (
	errBadID       = errors.New("fs: no such registered buffer on this file")
	errNotOwner    = errors.New("fs: caller does not own the process")
	errBadRegister = errors.New("fs: bad registration")
	errTooManyRegs = errors.New("fs: too many registered buffers")
	errTooManyOpen = errors.New("fs: too many open files")
)

// maxRegister bounds one registration (the address space, not memory: the
// mapping is the client's memory).
const maxRegister = 1 << 40

// registration is client memory mapped into the daemon once. Copies in
// flight hold it (inflight), so unregistering waits for them before it
// unmaps.
type registration struct {
	sh       *pinned.Shared // host registrations
	mem      []byte
	vmTgid   int    // KindVM: the registering process
	vmAddr   uint64 // and the range's address in it
	vmLen    uint64
	gpu      *ipcMapping // CUDA registrations: the opened allocation
	gpuOff   uint64      // and the registered range in it
	gpuLen   uint64
	rdma     func() // releases the RDMA registration; nil when none
	uid      uint32 // who registered it (regStats)
	inflight sync.WaitGroup
}

// size returns the registered length.
func (r *registration) size() uint64 {
	switch {
	case r.gpu != nil:
		return r.gpuLen
	case r.vmTgid != 0:
		return r.vmLen
	}
	return uint64(len(r.mem))
}

// mapped returns the bytes the registration maps into the daemon: what
// counts against MaxRegisteredBytes (a KindVM range maps nothing).
func (r *registration) mapped() uint64 {
	if r.vmTgid != 0 {
		return 0
	}
	return r.size()
}

// regTable holds the registrations of one open file description: they die
// with it, so a client that crashes leaks nothing (the kernel releases its
// files, FUSE releases the handle, the handle unmaps).
type regTable struct {
	fs *FS
	mu struct {
		sync.Mutex
		next uint64
		m    map[uint64]*registration
	}
}

// regStats are the daemon-wide figures of registered buffers: those
// live and the bytes they map, by user within the mount's bounds
// (userCounts), and how many were ever made.
type regStats struct {
	live, bytes userCounts
	total       atomic.Int64
}

// add records r, registered by user uid, and returns its id: EMFILE past
// Options.MaxRegistrations on this file, or past the mount's bounds or
// uid's share of them (regStats).
func (t *regTable) add(uid uint32, r *registration) (uint64, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mu.m == nil {
		t.mu.m = make(map[uint64]*registration)
	}
	if max := t.fs.opts.MaxRegistrations; len(t.mu.m) >= max {
		return 0, fmt.Errorf("fs: %d buffers registered on this file: %w", max, errTooManyRegs)
	}
	regs := &t.fs.regs
	if err := regs.live.take(uid); err != nil {
		return 0, err
	}
	if err := regs.bytes.takeN(uid, int(r.mapped())); err != nil {
		regs.live.put(uid)
		return 0, err
	}
	r.uid = uid
	t.mu.next++
	t.mu.m[t.mu.next] = r
	regs.total.Add(1)
	return t.mu.next, nil
}

// get returns registration id, held until the caller calls done.
func (t *regTable) get(id uint64) (*registration, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r, ok := t.mu.m[id]
	if !ok {
		return nil, fmt.Errorf("buffer %d: %w", id, errBadID)
	}
	r.inflight.Add(1)
	return r, nil
}

// byAddress reports whether registration id is of process memory by
// address (KindVM).
func (t *regTable) byAddress(id uint64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	r, ok := t.mu.m[id]
	return ok && r.vmTgid != 0
}

func (t *regTable) remove(id uint64) error {
	t.mu.Lock()
	r, ok := t.mu.m[id]
	delete(t.mu.m, id)
	t.mu.Unlock()
	if !ok {
		return fmt.Errorf("buffer %d: %w", id, errBadID)
	}
	t.release(r)
	return nil
}

func (t *regTable) release(r *registration) {
	r.inflight.Wait()
	if r.rdma != nil {
		r.rdma()
	}
	switch {
	case r.gpu != nil:
		if err := t.fs.ipc.release(r.gpu); err != nil {
			t.fs.log.WithError(err).Warn("close registered CUDA allocation")
		}
	case r.sh != nil:
		if err := r.sh.Close(); err != nil {
			t.fs.log.WithError(err).Warn("unmap registered buffer")
		}
	}
	t.fs.regs.live.put(r.uid)
	t.fs.regs.bytes.putN(r.uid, int(r.mapped()))
}

// closeAll releases every registration (the file was released).
func (t *regTable) closeAll() {
	t.mu.Lock()
	m := t.mu.m
	t.mu.m = nil
	t.mu.Unlock()
	for _, r := range m {
		t.release(r)
	}
}

// callerProc identifies the process behind a request. The request
// carries the thread id, uid and gid; the thread group and supplementary
// groups come from /proc, read only when needed (a read costs tens of
// microseconds, more than a small ioctl).
type callerProc struct {
	tid      int
	uid, gid uint32

	loaded bool
	tgid   int
	groups []uint32
	// noGroups: its groups were asked for once and /proc had no answer
	// (fixGroups); inGroup goes by the primary group alone since.
	noGroups bool
}

// procOf returns the caller of the request in ctx.
func procOf(ctx context.Context) (*callerProc, error) {
	c, ok := fuse.FromContext(ctx)
	if !ok || c.Pid == 0 {
		return nil, fmt.Errorf("no calling process: %w", errNotOwner)
	}
	return &callerProc{tid: int(c.Pid), uid: c.Uid, gid: c.Gid}, nil
}

// load reads the caller's thread group and groups from /proc and checks
// that it still runs with the uid the kernel put in the request.
func (p *callerProc) load() error {
	if p.loaded {
		return nil
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(p.tid) + "/status")
	if err != nil {
		return fmt.Errorf("caller %d: %w", p.tid, errNotOwner)
	}
	fsuid := -1
	for line := range strings.SplitSeq(string(b), "\n") {
		k, v, _ := strings.Cut(line, ":")
		f := strings.Fields(v)
		switch k {
		case "Tgid":
			if len(f) > 0 {
				p.tgid, _ = strconv.Atoi(f[0])
			}
		case "Uid":
			if len(f) == 4 {
				fsuid, _ = strconv.Atoi(f[3])
			}
		case "Groups":
			for _, g := range f {
				if n, err := strconv.ParseUint(g, 10, 32); err == nil {
					p.groups = append(p.groups, uint32(n))
				}
			}
		}
	}
	if p.tgid == 0 || fsuid != int(p.uid) {
		return fmt.Errorf("caller %d (uid %d in request, fsuid %d now): %w", p.tid, p.uid, fsuid, errNotOwner)
	}
	p.loaded = true
	return nil
}

// inGroup reports whether gid is among the caller's groups.
func (p *callerProc) inGroup(gid uint32) bool {
	if p.gid == gid {
		return true
	}
	if p.noGroups || p.load() != nil {
		return false
	}
	return slices.Contains(p.groups, gid)
}

// fixGroups reads the caller's groups now, while its thread id names it,
// for permission checks made later: a caller whose /proc has no answer
// keeps its primary group alone, as inGroup gives it then, and nothing is
// read for it again (the id may name another thread by then).
func (p *callerProc) fixGroups() {
	if p.load() != nil {
		p.noGroups = true
	}
}

// register maps the caller's memfd or shm file into the daemon.
func (f *FS) register(ctx context.Context, t *regTable, a *ioctl.RegisterArg) error {
	switch a.Kind {
	case ioctl.KindCUDA:
		return f.registerCUDA(ctx, t, a)
	case ioctl.KindVM:
		return f.registerVM(ctx, t, a)
	}
	if a.Kind != ioctl.KindHost {
		return fmt.Errorf("kind %d: %w", a.Kind, errBadRegister)
	}
	if a.Flags != 0 {
		return fmt.Errorf("register flags %#x: %w", a.Flags, ioctl.ErrFlags)
	}
	if a.Len == 0 || a.Len > maxRegister || a.Fd < 0 {
		return fmt.Errorf("fd %d, %d B: %w", a.Fd, a.Len, errBadRegister)
	}
	fd, err := takeFd(ctx, a.Fd)
	if err != nil {
		return err
	}
	if err := pinned.CheckShmem(fd); err != nil {
		// Not memory: maybe a file of a hung file system, whose close
		// would not come back.
		f.suspects.close(fd)
		return errors.Join(err, errBadRegister)
	}
	defer unix.Close(fd) // shmem: its close waits on no one
	sh, err := pinned.MapShared(fd, a.Offset, a.Len)
	if err != nil {
		return errors.Join(err, errBadRegister)
	}
	r := &registration{sh: sh, mem: sh.Bytes()}
	if f.opts.RegisterMemory != nil {
		if r.rdma, err = f.opts.RegisterMemory(r.mem); err != nil {
			f.log.WithError(err).Warn("RDMA registration of a buffer failed: its remote transfers are staged")
		}
	}
	uid, _ := caller(ctx)
	if a.ID, err = t.add(uid, r); err != nil {
		if r.rdma != nil {
			r.rdma()
		}
		_ = sh.Close()
		return err
	}
	return nil
}

// registerVM registers an address range of the caller's own memory: the
// daemon maps nothing, and copies reach the range through the thread of
// each request, which must belong to the registering process.
func (f *FS) registerVM(ctx context.Context, t *regTable, a *ioctl.RegisterArg) error {
	if a.Flags != 0 || a.Fd != -1 || a.Len == 0 || a.Len > maxRegister || a.Offset == 0 || a.Offset+a.Len < a.Offset {
		return fmt.Errorf("address registration flags %#x, fd %d, %d B at %#x: %w", a.Flags, a.Fd, a.Len, a.Offset, errBadRegister)
	}
	p, err := procOf(ctx)
	if err != nil {
		return err
	}
	if err := p.load(); err != nil {
		return err
	}
	a.ID, err = t.add(p.uid, &registration{vmTgid: p.tgid, vmAddr: a.Offset, vmLen: a.Len})
	return err
}

// Registrations returns the live registrations, how many were ever made,
// and the bytes mapped now.
func (m *Mount) Registrations() (live, total, bytes int64) {
	r := &m.fs.regs
	return int64(r.live.count()), r.total.Load(), int64(r.bytes.count())
}

// OpenFiles returns the open files of the mount, directories included
// (OpenDirs says how many), and their bound, Options.MaxOpen.
func (m *Mount) OpenFiles() (open, limit uint64) {
	return uint64(m.fs.opens.count()), uint64(m.fs.opts.MaxOpen)
}

// OpenDirs returns how many directory handles of the mount are open.
func (m *Mount) OpenDirs() int64 { return m.fs.dirs.Load() }

// registerCUDA opens a CUDA allocation of the caller once (its IPC handle)
// for PUT_BUF and GET_BUF: copies then go GPU <-> segment directly.
func (f *FS) registerCUDA(ctx context.Context, t *regTable, a *ioctl.RegisterArg) error {
	if a.Flags&^ioctl.RegisterDmabuf != 0 || a.Len == 0 {
		return fmt.Errorf("cuda registration flags %#x, %d B: %w", a.Flags, a.Len, errBadRegister)
	}
	dmabuf := -1
	if a.Flags&ioctl.RegisterDmabuf != 0 {
		fd, err := f.takeDmabuf(ctx, a.Fd)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		dmabuf = fd
	}
	gctx, err := f.gpuContext([16]byte{})
	if err != nil {
		return err
	}
	m, err := f.ipc.acquire(gctx, a.Handle)
	if err != nil {
		return errors.Join(err, errBadRegister)
	}
	if a.Offset > m.size || a.Len > m.size-a.Offset {
		_ = f.ipc.release(m)
		return fmt.Errorf("%d B at %d of a %d B allocation: %w", a.Len, a.Offset, m.size, errDevRange)
	}
	if dmabuf >= 0 {
		if err := checkDmabuf(dmabuf, m.size); err != nil {
			_ = f.ipc.release(m)
			return errors.Join(err, errBadRegister)
		}
		f.ipc.registerDmabuf(m, dmabuf)
	}
	uid, _ := caller(ctx)
	if a.ID, err = t.add(uid, &registration{gpu: m, gpuOff: a.Offset, gpuLen: a.Len}); err != nil {
		_ = f.ipc.release(m)
		return err
	}
	return nil
}

// takeFd returns the daemon's own copy of descriptor fd of the calling
// process (pidfd_getfd); the caller closes it.
func takeFd(ctx context.Context, fd int32) (int, error) {
	return takeFdIf(ctx, fd, nil)
}

// takeDmabuf is takeFd for a descriptor that must be a dma-buf: one that
// is not is refused before the daemon holds it, for the daemon's close
// of a file on a hung file system (one the caller serves itself) would
// hang the request.
func (f *FS) takeDmabuf(ctx context.Context, fd int32) (int, error) {
	own, err := takeFdIf(ctx, fd, func(tgid int) error {
		if _, err := pinned.DmabufSizeOf(tgid, int(fd)); err != nil {
			return errors.Join(err, errBadRegister)
		}
		return nil
	})
	if err != nil {
		return -1, err
	}
	// The caller may have swapped the descriptor in between: look at
	// what was taken, and let go of anything else off the request.
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(own, &sfs); err != nil || sfs.Type != dmabufMagic {
		f.suspects.close(own)
		return -1, fmt.Errorf("fd %d is not a dma-buf: %w", fd, errBadRegister)
	}
	return own, nil
}

// fdCloser closes descriptors callers gave that failed their checks: a
// file of a hung file system (a FUSE mount its caller serves and leaves
// unanswered, a dead NFS server) can make close wait forever, so they
// are closed off the request by a few goroutines. When those are all
// stuck and their queue is full, the failing request waits: its
// caller's, and no one else's.
type fdCloser struct {
	once sync.Once
	ch   chan int
}

const (
	fdClosers     = 4
	fdCloserQueue = 256
)

func (c *fdCloser) close(fd int) {
	c.once.Do(func() {
		c.ch = make(chan int, fdCloserQueue)
		for range fdClosers {
			go func() {
				for fd := range c.ch {
					_ = unix.Close(fd)
				}
			}()
		}
	})
	c.ch <- fd
}

// dmabufMagic is the file system magic of dma-bufs (DMA_BUF_MAGIC).
const dmabufMagic = 0x444d4142

// takeFdIf is takeFd that first runs check on the caller's thread group
// id, when given.
func takeFdIf(ctx context.Context, fd int32, check func(tgid int) error) (int, error) {
	if fd < 0 {
		return -1, fmt.Errorf("fd %d: %w", fd, errBadRegister)
	}
	p, err := procOf(ctx)
	if err != nil {
		return -1, err
	}
	if err := p.load(); err != nil {
		return -1, err
	}
	if check != nil {
		if err := check(p.tgid); err != nil {
			return -1, err
		}
	}
	pidfd, err := unix.PidfdOpen(p.tgid, 0)
	if err != nil {
		return -1, fmt.Errorf("pidfd_open %d: %w", p.tgid, err)
	}
	defer unix.Close(pidfd)
	own, err := unix.PidfdGetfd(pidfd, int(fd), 0)
	if err != nil {
		return -1, fmt.Errorf("take fd %d of process %d: %w", fd, p.tgid, err)
	}
	return own, nil
}

// checkDmabuf verifies that fd is a dma-buf of size bytes.
func checkDmabuf(fd int, size uint64) error {
	got, err := pinned.DmabufSize(fd)
	if err == nil && got != size {
		err = fmt.Errorf("dma-buf of %d B for an allocation of %d B", got, size)
	}
	return err
}
