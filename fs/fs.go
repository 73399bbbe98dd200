package fs

import (
	"context"
	"errors"
	"fmt"
	"math"
	rtmetrics "runtime/metrics"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// Options configures the file system.
type Options struct {
	// Store serves the objects. Required.
	Store *store.Store
	// Log receives one debug line per operation and warnings. Nil: logrus'
	// standard logger.
	Log *logrus.Logger
	// AllowOther lets users other than the daemon's use the mount.
	AllowOther bool
	// DefaultPermissions makes the kernel enforce mode bits.
	DefaultPermissions bool
	// EntryTimeout, AttrTimeout and NegativeTimeout are the kernel's cache
	// lifetimes. Every change made through this mount invalidates them, so
	// they only bound staleness of changes made elsewhere.
	EntryTimeout, AttrTimeout, NegativeTimeout time.Duration
	// MaxWrite is the largest read or write request (at most 1 MiB, the
	// kernel's request and pipe limit).
	MaxWrite int
	// MaxReadAhead bounds kernel readahead for mmap'ed reads.
	MaxReadAhead int
	// MaxBackground is the number of asynchronous requests the kernel may
	// keep in flight.
	MaxBackground int
	// Cluster says other daemons share the index: the kernel keeps no
	// attributes or negative entries, and changes seen on the index
	// invalidate the kernel's caches. Lookups read this node's view of
	// the index, which every commit waits for before it returns.
	Cluster bool
	// Status returns the document served as the root's
	// user.mooncake.status xattr (JSON). Nil serves the store's figures.
	Status func() ([]byte, error)
	// Registerer receives the per-operation metrics; nil registers none.
	Registerer prometheus.Registerer
	// Debug logs every FUSE request (very verbose).
	Debug bool
	// MaxOpen bounds the open files of the mount, directories included,
	// all users together, and a quarter of it those of any one user but
	// root; past either, open fails with ENFILE. MaxRegistrations bounds
	// the buffers registered on one open file, MaxRegistrationsTotal those
	// of the whole mount (each is a mapping in the daemon, and the kernel
	// allows a process about 65530) and MaxRegisteredBytes the address
	// space they take (a user other than root a quarter of either); past
	// any of them REGISTER_BUFFER fails with EMFILE.
	MaxOpen, MaxRegistrations, MaxRegistrationsTotal int
	MaxRegisteredBytes                               uint64
	// RegisterMemory, when set, registers a host buffer's mapping with
	// the RDMA device at REGISTER_BUFFER (remote transfers then go NIC
	// to NIC); release runs after the last copy, before the unmap. A
	// failure is logged and the buffer is staged instead.
	RegisterMemory func(mem []byte) (release func(), err error)
	// RegisterDevice, when set, registers a client's GPU allocation with
	// the RDMA device (GPUDirect RDMA), given a dma-buf fd of it: the
	// daemon's own export when it opens the IPC handle, else the one a
	// registration brings (RegisterDmabuf); the registration is the
	// opened mapping's, and release runs before the handle is closed. A
	// failure is logged once and the remote transfers are staged.
	RegisterDevice func(fd int, dev, n uint64) (release func(), err error)
}

// DefaultOptions returns options with every tunable set; Store is left nil.
func DefaultOptions() Options {
	return Options{
		AllowOther:            true,
		DefaultPermissions:    true,
		EntryTimeout:          time.Second,
		AttrTimeout:           time.Second,
		NegativeTimeout:       time.Second,
		MaxWrite:              1 << 20,
		MaxReadAhead:          1 << 20,
		MaxBackground:         64,
		MaxOpen:               1 << 17,
		MaxRegistrations:      1024,
		MaxRegistrationsTotal: 16384,
		MaxRegisteredBytes:    8 << 40, // a sixteenth of a 47-bit address space
	}
}

// Validate reports every bad field at once.
func (o Options) Validate() error {
	var errs []error
	if o.Store == nil {
		errs = append(errs, errors.New("fs: Options.Store is required"))
	}
	if o.MaxWrite < 4096 || o.MaxWrite > 1<<20 {
		errs = append(errs, fmt.Errorf("fs: MaxWrite %d not in [4096, 1 MiB]", o.MaxWrite))
	}
	if o.MaxReadAhead < 0 || o.MaxBackground < 0 {
		errs = append(errs, fmt.Errorf("fs: MaxReadAhead %d / MaxBackground %d negative", o.MaxReadAhead, o.MaxBackground))
	}
	if o.MaxOpen <= 0 || o.MaxRegistrations <= 0 || o.MaxRegistrationsTotal <= 0 || o.MaxRegisteredBytes == 0 {
		errs = append(errs, fmt.Errorf("fs: MaxOpen %d, MaxRegistrations %d, MaxRegistrationsTotal %d, MaxRegisteredBytes %d: each must be positive",
			o.MaxOpen, o.MaxRegistrations, o.MaxRegistrationsTotal, o.MaxRegisteredBytes))
	}
	for _, d := range []time.Duration{o.EntryTimeout, o.AttrTimeout, o.NegativeTimeout} {
		if d < 0 {
			errs = append(errs, fmt.Errorf("fs: negative cache timeout %v", d))
		}
	}
	return errors.Join(errs...)
}

// FS is the state shared by every node of one mount.
type FS struct {
	opts    Options
	st      *store.Store
	log     *logrus.Logger
	metrics *metrics
	splice  bool // large read replies are spliced (see splice.go)
	regs    regStats
	opens   userCounts // open files and directories (MaxOpen), by user
	// dirs counts open directory handles, which opens counts too
	// (status reports how many of the open files are directories).
	dirs atomic.Int64
	// renaming is read-held by each rename from before its store rename
	// until go-fuse moved the inode in its tree (renames.go).
	renaming sync.RWMutex
	// moves follows the renames in flight for the calls they make fail
	// (renames.go).
	moves *moves
	// ioctls counts the ioctls running, submitted calls included, and
	// when one last ended (Unix ns): ioctls copy client memory, whose
	// page faults can wait for ever (and GPU copies), and Unmount gives
	// up on them once none ends for its timeout.
	ioctls struct {
		running atomic.Int64
		lastEnd atomic.Int64
		// byUser counts the data-path ioctls of users other than root
		// running (share.go).
		byUser userCounts
	}
	gpus gpus
	ipc  ipcTable
	// ipcCached counts the handles client processes' caches hold.
	ipcCached atomic.Int64
	procs     procTable // client processes (proc.go)
	neg       negatives // names answered ENOENT (negative.go)
	suspects  fdCloser  // closes refused descriptors of callers (register.go)
	batches   batchStats
	// async counts the submitted vector batches still running (async.go):
	// unmounting stops them (asyncStop ends asyncCtx, which theirs derive
	// from) and waits for them; asyncHeld counts those held, running or
	// not yet waited for (at most maxAsyncTotal).
	async     sync.WaitGroup
	asyncHeld userCounts
	asyncCtx  context.Context
	asyncStop context.CancelFunc
	// hooks are tests' ways into the windows between a rename's and a
	// lookup's steps (none outside tests).
	hooks testHooks
}

// testHooks are functions tests set before mounting, each run at one
// step of a call when set.
type testHooks struct {
	// storeRenamed runs in a rename once the store moved the key,
	// before go-fuse's tree does.
	storeRenamed func(from, to string)
	// renameWaits runs in a rename before it takes its directories'
	// locks (renames.Rename).
	renameWaits func()
	// lookedUp runs in a lookup that found name in the store, before
	// go-fuse's tree enters it.
	lookedUp func(name string)
	// commitStale runs when a commit first found its file gone from its
	// name (commitFollowing), before it looks for it again.
	commitStale func(key string)
	// rewritten runs once an O_TRUNC writer published its version,
	// before the shared draft moves onto it (rebaseShared).
	rewritten func()
	// settling runs when a call waits for the renames in flight to hold
	// them off (namesSettled).
	settling func()
}

// batchStats count the keys of batch ioctls and where their time went:
// the whole handler, and the one transfer of each batch (WriteMany,
// ReadMany: reservation and copies). Their difference per key is the
// daemon's own work per key.
type batchStats struct {
	keys, handlerNs, transferNs atomic.Uint64
	// commitNs: the puts' time committing, after their copies were waited
	// for (BatchStats.CommitNs).
	commitNs atomic.Uint64
	// submits and submitNs: the submitted calls accepted and the time
	// their requests took in the handler, up to the reply (decoding, the
	// checks, opening GPU allocations), which the caller waits for.
	submits, submitNs atomic.Uint64
	// queueNs: the submitted calls' waits to start (BatchStats.QueueNs).
	queueNs atomic.Uint64
}

// BatchStats are the mount's batch figures since it started.
type BatchStats struct {
	Keys       uint64 `json:"keys"`
	HandlerNs  uint64 `json:"handler_ns"`
	TransferNs uint64 `json:"transfer_ns"`
	// CommitNs is the part of the put calls' own work (HandlerNs less
	// TransferNs) done after their chunks' copies: committing the keys
	// (the index, the values' records, the LRU, the kernel's caches), a
	// key that changed meanwhile put again alone among them. The rest is
	// decoding, checking and reserving, and the keys a call puts alone
	// outside its chunks.
	CommitNs uint64 `json:"commit_ns"`
	// CPUNs is the daemon process's CPU time (user and system, every
	// thread) when the figures were read: over a pass of batch calls its
	// difference per key is what the daemon spent on each key, copies and
	// FUSE included, however many calls overlapped (their handler times
	// add up waits and CPUs shared, this does not).
	CPUNs uint64 `json:"cpu_ns"`
	// LockWaitNs is the time the daemon's goroutines spent blocked on
	// locks (sync.Mutex, sync.RWMutex and the runtime's own), SchedWaitNs
	// their time ready to run but not running, about (from the runtime's
	// histogram, which times one wait in eight), and GCCPUNs the
	// collector's CPU time but its idle marking, an estimate the runtime
	// updates as collections end; all since the daemon started.
	// Over a pass of batch calls their differences per key say where a
	// key's handler time went beyond its work: waits for other calls'
	// locks, for a CPU, or the collector's share.
	LockWaitNs  uint64 `json:"lock_wait_ns"`
	SchedWaitNs uint64 `json:"sched_wait_ns"`
	GCCPUNs     uint64 `json:"gc_cpu_ns"`
	// LockPollNs is the time spent polling the store's contended locks
	// before taking them (store.LockPollNs), since the daemon started:
	// CPU time, which a handler's time counts as its work, spent waiting
	// for other calls. LockWaitNs counts only the waits that parked.
	LockPollNs uint64 `json:"lock_poll_ns"`
	// MinorFaults is the daemon process's minor page faults so far: over
	// a pass, the first touches of memory the kernel had to map, such as
	// heap pages given back and used again.
	MinorFaults uint64 `json:"minor_faults"`
	// Submitted is how many submitted calls (ABI 1.7) the mount holds:
	// running, or done and not yet waited for.
	Submitted int64 `json:"submitted"`
	// Submits counts the submitted calls accepted since the mount
	// started; SubmitNs is their requests' time in the handler up to the
	// reply (the caller is blocked for it, FUSE's round trip on top).
	Submits  uint64 `json:"submits"`
	SubmitNs uint64 `json:"submit_ns"`
	// QueueNs is the submitted calls' time between the go-ahead of their
	// submit's handler and the start of their own goroutine: a wait for a
	// thread to run them, which HandlerNs leaves out (a submitted call's
	// handler time is its submit's, up to the go-ahead, and its run's)
	// and SchedWaitNs counts too (a new goroutine's first wait is one the
	// runtime times).
	QueueNs uint64 `json:"queue_ns"`
}

// Batches returns the mount's batch figures.
func (m *Mount) Batches() BatchStats {
	b := &m.fs.batches
	st := BatchStats{Keys: b.keys.Load(), HandlerNs: b.handlerNs.Load(), TransferNs: b.transferNs.Load(), CommitNs: b.commitNs.Load(),
		Submitted: int64(m.fs.asyncHeld.count()), Submits: b.submits.Load(), SubmitNs: b.submitNs.Load(), QueueNs: b.queueNs.Load()}
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) == nil {
		st.CPUNs = uint64(ru.Utime.Nano() + ru.Stime.Nano())
		st.MinorFaults = uint64(ru.Minflt)
	}
	st.LockWaitNs, st.SchedWaitNs, st.GCCPUNs = runtimeWaits()
	st.LockPollNs = store.LockPollNs()
	return st
}

// schedSampled is the runtime's sampling of goroutine waits: it times
// one transition in eight (runtime/proc.go, gTrackingPeriod).
const schedSampled = 8

// runtimeWaits reads the runtime's lock waits, scheduling latency and
// collector CPU so far, in nanoseconds (BatchStats).
func runtimeWaits() (lock, sched, gc uint64) {
	s := []rtmetrics.Sample{{Name: "/sync/mutex/wait/total:seconds"}, {Name: "/sched/latencies:seconds"},
		{Name: "/cpu/classes/gc/total:cpu-seconds"}, {Name: "/cpu/classes/gc/mark/idle:cpu-seconds"}}
	rtmetrics.Read(s)
	ns := func(v rtmetrics.Value) uint64 {
		if v.Kind() != rtmetrics.KindFloat64 {
			return 0
		}
		return uint64(v.Float64() * 1e9)
	}
	// The collector's marking on Ps that had nothing else to run took no
	// one's CPU.
	lock, gc = ns(s[0].Value), max(ns(s[2].Value), ns(s[3].Value))-ns(s[3].Value)
	if s[1].Value.Kind() == rtmetrics.KindFloat64Histogram {
		// Each bucket's waits counted at its middle (its finite end for
		// the two open ones).
		h := s[1].Value.Float64Histogram()
		var sum float64
		for i, n := range h.Counts {
			lo, hi := h.Buckets[i], h.Buckets[i+1]
			mid := (lo + hi) / 2
			switch {
			case math.IsInf(lo, -1):
				mid = hi
			case math.IsInf(hi, 1):
				mid = lo
			}
			sum += float64(n) * mid
		}
		// The runtime times one goroutine wait in schedSampled and does
		// not scale the histogram up (it does the lock waits).
		sched = uint64(sum * schedSampled * 1e9)
	}
	return lock, sched, gc
}

// initCounts sets the bounds of what the mount counts by user (share.go)
// from f.opts.
func (f *FS) initCounts() {
	o := &f.opts
	f.opens = sharedCounts("open files and directories", o.MaxOpen, errTooManyOpen)
	f.regs.live = sharedCounts("registered buffers", o.MaxRegistrationsTotal, errTooManyRegs)
	f.regs.bytes = sharedCounts("bytes of registered buffers", int(min(o.MaxRegisteredBytes, math.MaxInt)), errTooManyRegs)
	f.asyncHeld = userCounts{what: "submitted calls not waited for", total: maxAsyncTotal, perUser: maxAsyncPerUser}
	f.ioctls.byUser = userCounts{what: "running ioctls", total: maxIoctlsTotal, perUser: maxIoctlsPerUser, rootFree: true}
}

func newFS(o Options) (*FS, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if o.Log == nil {
		o.Log = logrus.StandardLogger()
	}
	m, err := newMetrics(o.Registerer)
	if err != nil {
		return nil, err
	}
	f := &FS{opts: o, st: o.Store, log: o.Log, metrics: m, splice: SpliceReady(o.MaxWrite), moves: newMoves()}
	f.asyncCtx, f.asyncStop = context.WithCancel(context.Background())
	f.initCounts()
	f.ipc.register = o.RegisterDevice
	f.ipc.log = func(noExport bool, err error) {
		if noExport {
			// Drivers export no dma-buf of memory opened by IPC handle
			// (the H200's 580 does not): registrations that bring one
			// still go NIC to GPU.
			f.log.WithError(err).Info("the driver exports no dma-buf of client GPU memory: GPU buffers move NIC to GPU only when registered with their owner's dma-buf (register_tensor does); other remote transfers of GPU memory are staged")
			return
		}
		f.log.WithError(err).Warn("a client's GPU memory could not be registered for RDMA (GPUDirect): its remote transfers are staged")
	}
	if !f.splice {
		f.log.Warnf("fs.pipe-max-size is below %d B: read replies use writev, about a third slower than splice", PipeSizeFor(o.MaxWrite))
	}
	return f, nil
}
