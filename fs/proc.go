package fs

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// Client processes. What the daemon keeps for a process rather than for
// one of its open files (the CUDA IPC handles it opened) lives in a
// clientProc, found from a request's thread id and dropped when the
// process exits: a pidfd of each becomes readable then, and one goroutine
// waits for all of them in one epoll set.

// maxProcs bounds the processes the daemon keeps state for; one more
// takes the place of another, whose handles are closed (it opens them
// again when it needs them): no user can keep others from theirs.
const maxProcs = 4096

// maxTids bounds the thread-to-process cache; past it, it starts over.
const maxTids = 1 << 16

// stopID is the epoll key of the reaper's stop eventfd (client processes
// count from 1).
const stopID int32 = 0

type clientProc struct {
	tgid  int
	pidfd int
	id    uint32 // its key in the epoll set: never reused, unlike fds
	ipc   ipcCache
}

type procTable struct {
	once   sync.Once // starts it on first use
	mu     sync.Mutex
	byTgid map[int]*clientProc
	byID   map[uint32]*clientProc
	nextID uint32
	tids   map[int]int // thread id -> its process, checked at each use
	ep     int         // epoll set of the pidfds and of stop
	stop   int         // eventfd: the reaper ends
	done   chan struct{}
	err    error // why the table could not start
}

// startProcs makes the table and its reaper (once, on first use). A failure to make the epoll
// set leaves a table that refuses every lookup with the reason.
func (f *FS) startProcs() {
	t := &f.procs
	t.byTgid, t.byID, t.tids = map[int]*clientProc{}, map[uint32]*clientProc{}, map[int]int{}
	t.done = make(chan struct{})
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		t.err = fmt.Errorf("fs: epoll for client processes: %w", err)
		close(t.done)
		return
	}
	stop, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err == nil {
		err = unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, stop, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: stopID})
	}
	if err != nil {
		unix.Close(ep)
		t.err = fmt.Errorf("fs: eventfd for client processes: %w", err)
		close(t.done)
		return
	}
	t.ep, t.stop = ep, stop
	go f.reapProcs()
}

// stopProcs ends the reaper and drops every process's state.
func (f *FS) stopProcs() {
	t := &f.procs
	t.once.Do(func() {}) // none started after this
	if t.err != nil || t.ep == 0 {
		return
	}
	var one [8]byte
	one[0] = 1
	_, _ = unix.Write(t.stop, one[:])
	<-t.done
	t.mu.Lock()
	procs := t.byTgid
	t.byTgid, t.byID, t.tids = map[int]*clientProc{}, map[uint32]*clientProc{}, map[int]int{}
	t.err = errors.New("fs: unmounted")
	t.mu.Unlock()
	for _, cp := range procs {
		f.dropProc(cp)
	}
	unix.Close(t.ep)
	unix.Close(t.stop)
}

func (f *FS) reapProcs() {
	t := &f.procs
	defer close(t.done)
	evs := make([]unix.EpollEvent, 64)
	for {
		n, err := unix.EpollWait(t.ep, evs, int(ipcSweep.Milliseconds()))
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			f.log.WithError(err).Error("wait for client processes; their state stays until unmount")
			return
		}
		for _, ev := range evs[:n] {
			id := uint32(ev.Fd)
			if id == uint32(stopID) {
				return
			}
			t.mu.Lock()
			cp := t.byID[id]
			if cp != nil {
				t.forgetLocked(cp)
			}
			t.mu.Unlock()
			if cp != nil {
				f.dropProc(cp)
			}
		}
		f.sweepIPC()
	}
}

// forgetLocked takes cp out of the table and its pidfd out of the epoll
// set; dropProc then releases what it held.
// Its threads stay in t.tids: every lookup checks a thread's process
// anew, and one that has no state any more is dropped there.
func (t *procTable) forgetLocked(cp *clientProc) {
	delete(t.byID, cp.id)
	delete(t.byTgid, cp.tgid)
	_ = unix.EpollCtl(t.ep, unix.EPOLL_CTL_DEL, cp.pidfd, nil)
}

// dropProc releases what a process held.
func (f *FS) dropProc(cp *clientProc) {
	f.ipcCloseAll(&cp.ipc)
	unix.Close(cp.pidfd)
}

// inGroup reports whether thread tid belongs to process tgid now (EPERM:
// it does, and the daemon may not signal it).
func inGroup(tgid, tid int) bool {
	err := unix.Tgkill(tgid, tid, 0)
	return err == nil || err == unix.EPERM
}

// sameProcess reports whether thread other, still running, is of the
// process of thread tid (the procfs entry of its task there exists).
func sameProcess(tid, other uint32) bool {
	var st unix.Stat_t
	return tid != 0 && other != 0 &&
		unix.Stat("/proc/"+strconv.FormatUint(uint64(tid), 10)+"/task/"+strconv.FormatUint(uint64(other), 10), &st) == nil
}

// clockTicks is the unit of the start times in /proc/TID/stat (USER_HZ,
// 100 on every Linux the kernel's ABI allows).
const clockTicks = 100

// bootTicks returns the time since boot in clock ticks, as the kernel
// counts a task's start.
func bootTicks() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return 0
	}
	return ts.Sec*clockTicks + ts.Nsec/(1e9/clockTicks)
}

// startedBy reports whether thread tid runs and started no later than
// tick (bootTicks): a thread id the kernel gave again to a later thread
// (in a child of fork, say) is not the thread that held it at tick.
// Within one tick it cannot tell, and says yes: the kernel hands thread
// ids out in a cycle, so one comes back within a tick only to root
// setting ns_last_pid, while a thread that opens a file less than a tick
// after it started is common (a program's first file).
func startedBy(tid uint32, tick int64) bool {
	if tid == 0 || tick == 0 {
		return false
	}
	f := statFields(tid)
	if len(f) < 20 {
		return false
	}
	// starttime is field 22.
	start, err := strconv.ParseInt(f[19], 10, 64)
	return err == nil && start <= tick
}

// statFields returns the fields of /proc/TID/stat after the command
// name (field 3, the state, is the first), nil if it cannot be read.
func statFields(tid uint32) []string {
	b, err := os.ReadFile("/proc/" + strconv.FormatUint(uint64(tid), 10) + "/stat")
	if err != nil {
		return nil
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b[i+1:]))
}

// proc returns the state of the process behind p, made on first use.
func (f *FS) proc(p *callerProc) (*clientProc, error) {
	t := &f.procs
	t.once.Do(f.startProcs)
	t.mu.Lock()
	if err := t.err; err != nil {
		t.mu.Unlock()
		return nil, err
	}
	if tgid, ok := t.tids[p.tid]; ok {
		if cp := t.byTgid[tgid]; cp != nil && inGroup(tgid, p.tid) {
			t.mu.Unlock()
			return cp, nil
		}
		delete(t.tids, p.tid)
	}
	t.mu.Unlock()
	if err := p.load(); err != nil {
		return nil, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.err != nil {
		return nil, t.err
	}
	if len(t.tids) >= maxTids {
		clear(t.tids)
	}
	if cp := t.byTgid[p.tgid]; cp != nil {
		t.tids[p.tid] = p.tgid
		return cp, nil
	}
	if len(t.byTgid) >= maxProcs {
		for _, old := range t.byTgid { // any one: map order is random
			t.forgetLocked(old)
			go f.dropProc(old)
			break
		}
	}
	pidfd, err := unix.PidfdOpen(p.tgid, 0)
	if err != nil {
		return nil, fmt.Errorf("pidfd_open %d: %w", p.tgid, err)
	}
	t.nextID++
	if t.nextID == uint32(stopID) {
		t.nextID++
	}
	cp := &clientProc{tgid: p.tgid, pidfd: pidfd, id: t.nextID}
	if err := unix.EpollCtl(t.ep, unix.EPOLL_CTL_ADD, pidfd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(cp.id)}); err != nil {
		unix.Close(pidfd)
		return nil, fmt.Errorf("fs: watch process %d: %w", p.tgid, err)
	}
	t.byTgid[p.tgid], t.byID[cp.id] = cp, cp
	t.tids[p.tid] = p.tgid
	return cp, nil
}

// ProcStats are the client processes the daemon keeps state for and the
// CUDA IPC handles open for them.
type ProcStats struct {
	Procs int `json:"procs"`
	IPC   int `json:"ipc_handles"`
}

// Procs returns the mount's client-process figures.
func (m *Mount) Procs() ProcStats {
	t := &m.fs.procs
	t.mu.Lock()
	procs := make([]*clientProc, 0, len(t.byTgid))
	for _, cp := range t.byTgid {
		procs = append(procs, cp)
	}
	t.mu.Unlock()
	s := ProcStats{Procs: len(procs)}
	for _, cp := range procs {
		cp.ipc.mu.Lock()
		s.IPC += len(cp.ipc.m)
		cp.ipc.mu.Unlock()
	}
	return s
}

// capSysAdmin is CAP_SYS_ADMIN's bit in a capability set.
const capSysAdmin = 21

// hasCapability says whether thread tid has capability bit in its
// effective set (/proc/TID/status, CapEff): false when that cannot be
// read.
func hasCapability(tid uint32, bit uint) bool {
	b, err := os.ReadFile("/proc/" + strconv.FormatUint(uint64(tid), 10) + "/status")
	if err != nil {
		return false
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && caps&(1<<bit) != 0
		}
	}
	return false
}
