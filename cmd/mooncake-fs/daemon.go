package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/sirupsen/logrus"

	"github.com/mooncake-fs/mooncake-fs/cuda"
	mfs "github.com/mooncake-fs/mooncake-fs/fs"
	"github.com/mooncake-fs/mooncake-fs/pinned"
	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// mountConfig is everything "mount" takes from its flags.
type mountConfig struct {
	dir         string
	size        uint64
	segmentSize uint64
	evict       string
	high, low   float64
	huge        string
	allowOther  bool
	metrics     string
	logLevel    string
	fuseDebug   bool
	node        string
	pinMax      uint64
	maxOpen     int
	cpus        []int // nil: wherever the scheduler puts them
	stopTimeout time.Duration
	cacheTTL    time.Duration // the kernel's entry, attribute and negative timeouts
	cluster     clusterConfig
	rdma        rdmaConfig
}

func defaultSize() uint64 {
	// A quarter of available memory, at most 4 GiB, at least 256 MiB.
	avail := uint64(1 << 30)
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for line := range strings.SplitSeq(string(b), "\n") {
			var kb uint64
			if _, err := fmt.Sscanf(line, "MemAvailable: %d kB", &kb); err == nil {
				avail = kb << 10
			}
		}
	}
	s := min(avail/4, 4<<30)
	s = max(s, 256<<20)
	return s &^ (2<<20 - 1)
}

func parseMountFlags(args []string) (*mountConfig, error) {
	c := &mountConfig{size: defaultSize(), segmentSize: 1 << 30, maxOpen: mfs.DefaultOptions().MaxOpen}
	fl := flag.NewFlagSet("mount", flag.ContinueOnError)
	fl.Var(sizeFlag{&c.size}, "size", "store capacity (e.g. 4GiB); default: a quarter of available memory, at most 4 GiB")
	fl.Var(sizeFlag{&c.segmentSize}, "segment-size", "largest single segment (one pinned region)")
	fl.StringVar(&c.evict, "evict", "on", "on: evict least recently used objects when full; off: writes fail with ENOSPC")
	fl.IntVar(&c.maxOpen, "max-open", c.maxOpen, "open files and directories of the mount, all users together (ENFILE beyond); a user other than root may hold a quarter")
	fl.Float64Var(&c.high, "evict-high", 0.95, "eviction starts above this fraction of capacity")
	fl.Float64Var(&c.low, "evict-low", 0.85, "eviction stops below this fraction of capacity")
	fl.StringVar(&c.huge, "hugepages", "auto", "auto: 2 MiB pages if obtainable; require; off")
	fl.BoolVar(&c.allowOther, "allow-other", true, "let other users use the mount (mode bits are enforced)")
	fl.StringVar(&c.metrics, "metrics", "", "serve Prometheus metrics at ADDR (e.g. 127.0.0.1:9100); off when empty")
	fl.StringVar(&c.logLevel, "log-level", "info", "debug, info, warn or error; debug logs one line per operation")
	fl.BoolVar(&c.fuseDebug, "fuse-debug", false, "log every FUSE request")
	fl.DurationVar(&c.stopTimeout, "stop-timeout", 10*time.Second, "on SIGTERM: detach lazily when files stay open this long (then serve them until closed); exit 1 once ioctls are running and none ended for this long")
	fl.DurationVar(&c.cacheTTL, "cache-timeout", mfs.DefaultOptions().EntryTimeout, "how long the kernel trusts names and attributes it looked up (0: it asks every time); in a cluster, attributes and missing names are never kept")
	fl.StringVar(&c.node, "node", "", "this node's name in replica lists (default: local; in a cluster: the host name)")
	fl.StringVar(&c.cluster.etcd, "etcd", "", "join a cluster whose index is in etcd at URL[,URL...] (e.g. http://127.0.0.1:2379)")
	fl.StringVar(&c.cluster.listen, "listen", "127.0.0.1:7070", "cluster: serve this node's segments to peers at ADDR")
	fl.StringVar(&c.cluster.advertise, "advertise", "", "cluster: the address peers dial (default: the --listen address)")
	fl.StringVar(&c.cluster.tokenFile, "token-file", "", "cluster: file holding the shared cluster token (at least 16 bytes)")
	fl.StringVar(&c.cluster.prefix, "etcd-prefix", "/mooncake/", "cluster: etcd key prefix of this file system")
	fl.DurationVar(&c.cluster.ttl, "node-ttl", 5*time.Second, "cluster: a node that stops renewing its lease this long is dead")
	c.pinMax = ^uint64(0)
	if v := os.Getenv("MOONCAKE_PIN_MAX"); v != "" {
		if n, err := parseSize(v); err == nil {
			c.pinMax = n
		} else {
			return nil, fmt.Errorf("MOONCAKE_PIN_MAX: %w", err)
		}
	}
	fl.Var(sizeFlag{&c.pinMax}, "pin-max", "register at most this much segment memory with CUDA (env MOONCAKE_PIN_MAX); 0: none; default: all")
	fl.StringVar(&c.rdma.mode, "rdma", "auto", "cluster: auto moves remote bytes over RDMA where this node and the peer have a device with an active port; off: TCP only")
	var rdmaDevices string
	fl.StringVar(&rdmaDevices, "rdma-devices", "", "cluster: use only these RDMA devices, first usable one taken, e.g. mlx5_0,mlx5_1; default: one on the NUMA node of the daemon's CPUs first")
	fl.StringVar(&c.rdma.fake, "rdma-fake", "", "testing only: use a software RDMA NIC whose fabric is the folder DIR (daemons sharing DIR reach each other)")
	cpus := os.Getenv("MOONCAKE_CPUS")
	fl.StringVar(&cpus, "cpus", cpus, "run the daemon's threads on these CPUs only, e.g. 2,3 or 0-3 (env MOONCAKE_CPUS); default: any")
	if err := fl.Parse(args); err != nil {
		return nil, err
	}
	dir, err := mountpointArg(fl.Args())
	if err != nil {
		return nil, err
	}
	if c.dir, err = filepath.Abs(dir); err != nil {
		return nil, err
	}
	var errs []error
	if rdmaDevices != "" {
		c.rdma.devices = strings.Split(rdmaDevices, ",")
	}
	if err := c.rdma.check(); err != nil {
		errs = append(errs, err)
	}
	if cpus != "" {
		if c.cpus, err = parseCPUList(cpus); err != nil {
			errs = append(errs, fmt.Errorf("--cpus: %w", err))
		}
	}
	if c.node == "" {
		c.node = "local"
		if c.cluster.etcd != "" {
			if h, err := os.Hostname(); err == nil && h != "" {
				c.node = h
			}
		}
	}
	if !store.ValidNodeName(c.node) {
		errs = append(errs, fmt.Errorf("--node %q: letters, digits, '.', '-' and '_', at most %d", c.node, store.MaxNodeName))
	}
	if c.stopTimeout < 100*time.Millisecond || c.stopTimeout > time.Hour {
		errs = append(errs, fmt.Errorf("--stop-timeout %v: want 100ms to 1h", c.stopTimeout))
	}
	if c.cacheTTL < 0 || c.cacheTTL > 24*time.Hour {
		errs = append(errs, fmt.Errorf("--cache-timeout %v: want 0 to 24h", c.cacheTTL))
	}
	if c.cluster.etcd != "" && (c.cluster.ttl < time.Second || c.cluster.ttl > 5*time.Minute) {
		errs = append(errs, fmt.Errorf("--node-ttl %v: want 1s to 5m", c.cluster.ttl))
	}
	if c.cluster.etcd == "" && c.cluster.tokenFile != "" {
		errs = append(errs, errors.New("--token-file without --etcd"))
	}
	if c.evict != "on" && c.evict != "off" {
		errs = append(errs, fmt.Errorf("--evict %q: want on or off", c.evict))
	}
	if c.size < 4<<20 {
		errs = append(errs, fmt.Errorf("--size %d: at least 4 MiB", c.size))
	}
	if c.maxOpen < 4 || c.maxOpen > 1<<24 {
		errs = append(errs, fmt.Errorf("--max-open %d: want 4 to %d", c.maxOpen, 1<<24))
	}
	if c.segmentSize < 2<<20 {
		errs = append(errs, fmt.Errorf("--segment-size %d: at least 2 MiB", c.segmentSize))
	}
	if !(0 < c.low && c.low <= c.high && c.high <= 1) {
		errs = append(errs, fmt.Errorf("--evict-low %v / --evict-high %v: want 0 < low <= high <= 1", c.low, c.high))
	}
	if _, err := hugeMode(c.huge); err != nil {
		errs = append(errs, err)
	}
	if _, err := logrus.ParseLevel(c.logLevel); err != nil {
		errs = append(errs, fmt.Errorf("--log-level: %w", err))
	}
	return c, errors.Join(errs...)
}

func hugeMode(s string) (pinned.HugeMode, error) {
	switch s {
	case "auto":
		return pinned.HugeAuto, nil
	case "require", "on":
		return pinned.HugeRequire, nil
	case "off":
		return pinned.HugeOff, nil
	}
	return 0, fmt.Errorf("--hugepages %q: want auto, require or off", s)
}

// daemon is one running mount with everything under it.
type daemon struct {
	cfg     *mountConfig
	log     *logrus.Logger
	regions []*pinned.Region
	segs    *segment.Table
	eng     *transfer.Engine
	idx     store.Index
	st      *store.Store
	mnt     *mfs.Mount
	reg     *prometheus.Registry
	started time.Time
	gpuCtx  *cuda.Context
	cudaPin *pinned.CUDAPin
	gpus    []cuda.GPU
	cl      *cluster // nil on one machine
	rdma    *rdmaState
}

// daemonGCPercent is the daemon's GOGC unless the environment sets one.
const daemonGCPercent = 200

// daemonMemoryLimit is the daemon's soft memory limit (GOMEMLIMIT) unless
// the environment sets one, for a store whose index may take meta bytes
// (store.Options.MetaLimit): room for the heap at that bound as
// daemonGCPercent lets it grow (the live heap is about 1.1-1.3 times the
// metadata counted; 505k keys of 4 KiB: 150 MiB counted, 167 MB live),
// and 1 GiB for the requests and transfers in flight (a 1 MiB buffer a
// request, 4 MiB bounce buffers for remote copies). Past it the
// collector runs sooner. Without it a burst of requests (a thousand 1
// MiB reads at once, each holding a reply buffer of go-fuse's pool) left
// a collection goal of gigabytes behind it, which later traffic then
// filled. Not in a cluster, whose index cache holds every node's
// entries.
func daemonMemoryLimit(meta uint64) int64 {
	return int64(min(4*meta+1<<30, math.MaxInt64/2))
}

// heapInUse is the Go heap's spans in use: its objects, live or not yet
// collected, and the free room in their spans.
func heapInUse() uint64 {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}, {Name: "/memory/classes/heap/unused:bytes"}}
	metrics.Read(s)
	var n uint64
	for _, v := range s {
		if v.Value.Kind() == metrics.KindUint64 {
			n += v.Value.Uint64()
		}
	}
	return n
}

func runMount(args []string) error {
	cfg, err := parseMountFlags(args)
	if err != nil {
		return err
	}
	reexec()
	if os.Getenv("GOGC") == "" {
		// The heap is the index: long-lived objects, scanned by every
		// collection. Collecting at 3x the live heap rather than 2x
		// halves the collector's share of a put (a third of the
		// daemon's CPU with a million keys, at 100).
		debug.SetGCPercent(daemonGCPercent)
	}
	if cfg.cpus != nil {
		// Before the segments, CUDA and FUSE start their threads.
		if err := confineToCPUs(cfg.cpus); err != nil {
			return fmt.Errorf("--cpus: %w", err)
		}
	}
	log := logrus.New()
	log.SetOutput(os.Stderr)
	lvl, _ := logrus.ParseLevel(cfg.logLevel)
	log.SetLevel(lvl)
	// Catch signals before anything is mounted, so a SIGTERM at any point
	// after READY unmounts cleanly instead of killing the process.
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	d := &daemon{cfg: cfg, log: log, started: time.Now(), reg: prometheus.NewRegistry()}
	d.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if err := d.start(); err != nil {
		d.stop()
		return err
	}
	if err := startWatchdog(cfg.dir); err != nil {
		log.WithError(err).Warn("no watchdog: a kill of this daemon may leave the mount hung")
	}
	// The harness and scripts wait for this line.
	fmt.Printf("READY %s\n", cfg.dir)
	log.WithFields(logrus.Fields{"mountpoint": cfg.dir, "size": formatSize(cfg.size), "segments": len(d.regions)}).Info("mounted")

	unmounted := make(chan struct{})
	go func() { d.mnt.Wait(); close(unmounted) }()
	select {
	case s := <-sigs:
		log.WithField("signal", s.String()).Info("unmounting")
		if err := d.mnt.Unmount(cfg.stopTimeout); errors.Is(err, mfs.ErrRequestsRunning) {
			// Their copies may still touch the segments and the
			// engine: exit without releasing them. The exit ends the
			// connection, and with it those requests' calls.
			log.WithError(err).Error("exiting with requests still running")
			d.leaveCluster()
			return err
		} else if err != nil {
			log.WithError(err).Warn("unmount")
		}
	case <-unmounted:
		log.Info("unmounted from outside")
	}
	d.stop()
	log.Info("stopped")
	return nil
}

func (d *daemon) start() error {
	mode, _ := hugeMode(d.cfg.huge)
	d.segs = segment.NewTable()
	remaining := d.cfg.size
	for id := segment.ID(0); remaining > 0; id++ {
		sz := min(remaining, d.cfg.segmentSize)
		po := pinned.DefaultOptions()
		po.Size = sz
		po.Huge = mode
		r, err := pinned.Map(po)
		if err != nil {
			return fmt.Errorf("segment %d (%s): %w", id, formatSize(sz), err)
		}
		d.regions = append(d.regions, r)
		for _, w := range r.Info().Warnings {
			d.log.Warn(w)
		}
		if err := d.segs.Add(segment.NewSegment(id, r.Bytes()[:sz])); err != nil {
			return err
		}
		remaining -= sz
	}
	d.pinForCUDA()
	var err error
	so := store.DefaultOptions()
	so.Node = d.cfg.node
	eo := transfer.Options{Local: d.segs, Registerer: d.reg, Self: d.cfg.node}
	if d.cfg.cpus != nil {
		// runtime.NumCPU still counts the CPUs the process started with.
		eo.Workers = len(d.cfg.cpus)
	}
	if d.cfg.cluster.etcd != "" {
		if err := d.startCluster(); err != nil {
			return err
		}
		d.cl.storeOptions(&so)
		eo.Remote = d.cl.tr
		d.startRDMA()
		eo.RDMA = d.rdma.path
	} else {
		d.idx = store.NewEmbeddedFor(store.KeysFor(d.segs.Stats().Size))
	}
	if d.eng, err = transfer.New(eo); err != nil {
		return err
	}
	so.Index = d.idx
	so.Segments = d.segs
	so.Engine = d.eng
	so.Evict = d.cfg.evict == "on"
	so.HighWater, so.LowWater = d.cfg.high, d.cfg.low
	if d.st, err = store.New(so); err != nil {
		return err
	}
	if os.Getenv("GOMEMLIMIT") == "" && d.cl == nil {
		// (In a cluster the index's cache holds every node's entries,
		// which this node's bound does not bound.)
		debug.SetMemoryLimit(daemonMemoryLimit(d.st.Stats().MetaLimit))
	}
	if d.cl != nil {
		if err := d.cl.serve(); err != nil {
			return err
		}
	}
	d.reg.MustRegister(newStoreCollector(d))
	fo := mfs.DefaultOptions()
	fo.Store = d.st
	fo.Log = d.log
	fo.AllowOther = d.cfg.allowOther
	fo.Registerer = d.reg
	fo.Debug = d.cfg.fuseDebug
	fo.MaxOpen = d.cfg.maxOpen
	fo.EntryTimeout, fo.AttrTimeout, fo.NegativeTimeout = d.cfg.cacheTTL, d.cfg.cacheTTL, d.cfg.cacheTTL
	fo.Status = func() ([]byte, error) { return json.Marshal(d.status()) }
	fo.Cluster = d.cl != nil
	if d.rdma != nil && d.rdma.path != nil {
		fo.RegisterMemory = d.rdma.path.Register
		fo.RegisterDevice = d.rdma.path.RegisterDevice
	}
	if d.mnt, err = mfs.MountFS(d.cfg.dir, fo); err != nil {
		return err
	}
	if d.cfg.metrics != "" {
		ln, err := net.Listen("tcp", d.cfg.metrics)
		if err != nil {
			return fmt.Errorf("--metrics %s: %w", d.cfg.metrics, err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(d.reg, promhttp.HandlerOpts{}))
		// Profiles of the running daemon, e.g.
		// go tool pprof http://ADDR/debug/pprof/profile?seconds=10
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		go func() { _ = http.Serve(ln, mux) }()
		d.log.WithField("addr", ln.Addr().String()).Info("metrics")
	}
	return nil
}

// pinForCUDA registers the segments with CUDA within the quota, so GPU
// copies run at line rate. Without a GPU or driver nothing happens; a
// failure is one warning and copies fall back to pageable speed.
func (d *daemon) pinForCUDA() {
	if d.cfg.pinMax == 0 {
		return
	}
	if err := cuda.Init(); err != nil {
		d.log.WithError(err).Debug("no CUDA: segments not registered with a GPU")
		return
	}
	if gs, err := cuda.Discover(); err == nil {
		d.gpus = gs
	}
	ctx, err := cuda.Retain(0)
	if err != nil {
		d.log.WithError(err).Warn("CUDA context: segments stay pageable, GPU copies run at pageable speed")
		return
	}
	d.gpuCtx = ctx
	d.cudaPin = pinned.NewCUDAPin(ctx, d.cfg.pinMax)
	start := time.Now()
	warned := false
	for _, r := range d.regions {
		if w := d.cudaPin.Pin(r); w != "" && !warned {
			d.log.Warn(w)
			warned = true
		}
	}
	d.log.WithFields(logrus.Fields{"bytes": d.cudaPin.Pinned(), "ms": time.Since(start).Milliseconds()}).Info("segments pinned for CUDA")
}

func (d *daemon) stop() {
	d.leaveCluster()
	if d.st != nil {
		d.st.Close()
	}
	if d.idx != nil {
		_ = d.idx.Close()
	}
	if d.cl != nil {
		d.cl.closeClient()
	}
	if d.eng != nil {
		d.eng.Close()
	}
	d.rdma.close(d.log)
	if d.cudaPin != nil {
		for _, err := range d.cudaPin.Unpin() {
			d.log.WithError(err).Warn("unregister segment from CUDA")
		}
	}
	if d.gpuCtx != nil {
		_ = d.gpuCtx.Release()
	}
	for _, r := range d.regions {
		if err := r.Close(); err != nil {
			d.log.WithError(err).Warn("release segment memory")
		}
	}
}

// leaveCluster leaves the cluster, if the daemon is in one: peers stop
// sending here. Before anything else stops.
func (d *daemon) leaveCluster() {
	if d.cl != nil {
		d.cl.stop()
	}
}

// Status is the document behind "mooncake-fs status --json".
type Status struct {
	Mountpoint    string          `json:"mountpoint"`
	Node          string          `json:"node"`
	PID           int             `json:"pid"`
	UptimeSeconds float64         `json:"uptime_s"`
	Capacity      uint64          `json:"capacity"`
	Used          uint64          `json:"used"`
	Free          uint64          `json:"free"`
	LargestFree   uint64          `json:"largest_free"`
	Fragmentation float64         `json:"fragmentation"`
	Objects       int             `json:"objects"`
	OpenObjects   int             `json:"open_objects"`
	OpenFiles     LimitStatus     `json:"open_files"`
	OpenDirs      int64           `json:"open_dirs"`
	Batches       mfs.BatchStats  `json:"batches"`
	Metadata      LimitStatus     `json:"metadata_bytes"`
	Evict         EvictStatus     `json:"evict"`
	Commits       uint64          `json:"commits"`
	Revokes       uint64          `json:"revokes"`
	Memory        MemoryStatus    `json:"memory"`
	Segments      []SegmentStatus `json:"segments"`
	Transfer      transfer.Stats  `json:"transfer"`
	Fuse          map[string]any  `json:"fuse"`
	Registrations RegStatus       `json:"registrations"`
	Clients       mfs.ProcStats   `json:"clients"`
	GPUs          []cuda.GPU      `json:"gpus,omitempty"`
	Cluster       *ClusterStatus  `json:"cluster,omitempty"`
	RDMA          RDMAStatus      `json:"rdma"`
	CPUs          int             `json:"cpus"`
	// Affinity is the CPUs the daemon runs on (--cpus), e.g. "0-15".
	Affinity string `json:"cpu_affinity"`
}

// LimitStatus is a bounded resource users can make the daemon hold.
type LimitStatus struct {
	Used  uint64 `json:"used"`
	Limit uint64 `json:"limit"`
}

// RegStatus counts client buffers registered through REGISTER_BUFFER.
type RegStatus struct {
	Live  int64 `json:"live"`
	Total int64 `json:"total"`
	Bytes int64 `json:"bytes"`
}

// EvictStatus describes eviction.
type EvictStatus struct {
	Enabled      bool    `json:"enabled"`
	High         float64 `json:"high"`
	Low          float64 `json:"low"`
	Evictions    uint64  `json:"evictions"`
	EvictedBytes uint64  `json:"evicted_bytes"`
}

// MemoryStatus says what memory backs the segments.
type MemoryStatus struct {
	Hugepages     bool   `json:"hugepages"`
	PageSize      uint64 `json:"page_size"`
	LockedBytes   uint64 `json:"locked_bytes"`
	HugeBytes     uint64 `json:"hugepage_bytes"`
	ReservedPages int    `json:"reserved_pages"`
	CUDAPinned    uint64 `json:"cuda_pinned_bytes"`
	// HeapBytes is the Go heap in use (spans holding objects, live or not
	// yet collected) and HeapLimit the soft memory limit
	// (daemonMemoryLimit, or GOMEMLIMIT).
	HeapBytes  uint64   `json:"heap_bytes"`
	HeapLimit  int64    `json:"heap_limit_bytes"`
	PrefaultMS float64  `json:"prefault_ms"`
	Warnings   []string `json:"warnings,omitempty"`
}

// SegmentStatus is one segment.
type SegmentStatus struct {
	ID       uint32 `json:"id"`
	Size     uint64 `json:"size"`
	Used     uint64 `json:"used"`
	Huge     bool   `json:"hugepages"`
	PageSize uint64 `json:"page_size"`
	Locked   bool   `json:"locked"`
}

func (d *daemon) status() Status {
	st := d.st.Stats()
	s := Status{
		Mountpoint:    d.cfg.dir,
		Node:          d.st.Node(),
		PID:           os.Getpid(),
		UptimeSeconds: time.Since(d.started).Seconds(),
		Capacity:      st.Segments.Size,
		Used:          st.Segments.Used,
		Free:          st.Segments.Free,
		LargestFree:   st.Segments.LargestFree,
		Fragmentation: st.Segments.Fragmentation,
		Objects:       st.Objects,
		OpenObjects:   st.OpenObjects,
		Metadata:      LimitStatus{Used: st.MetaBytes, Limit: st.MetaLimit},
		Evict: EvictStatus{Enabled: d.cfg.evict == "on", High: d.cfg.high, Low: d.cfg.low,
			Evictions: st.Evictions, EvictedBytes: st.EvictedBytes},
		Commits:  st.Commits,
		Revokes:  st.Revokes,
		Transfer: d.eng.Stats(),
		RDMA:     d.rdma.statusNow(),
		Fuse:     d.mnt.Settings(),
		CPUs:     runtime.NumCPU(),
	}
	if cpus, err := allowedCPUs(); err == nil {
		s.Affinity = formatCPUList(cpus)
	}
	s.Registrations.Live, s.Registrations.Total, s.Registrations.Bytes = d.mnt.Registrations()
	s.OpenFiles.Used, s.OpenFiles.Limit = d.mnt.OpenFiles()
	s.OpenDirs = d.mnt.OpenDirs()
	s.Batches = d.mnt.Batches()
	s.Clients = d.mnt.Procs()
	s.GPUs = d.gpus
	if d.cl != nil {
		s.Cluster = d.cl.status()
	}
	if d.cudaPin != nil {
		s.Memory.CUDAPinned = d.cudaPin.Pinned()
	}
	s.Memory.Hugepages = len(d.regions) > 0
	s.Memory.HeapBytes, s.Memory.HeapLimit = heapInUse(), debug.SetMemoryLimit(-1)
	for i, r := range d.regions {
		in := r.Info()
		seg := d.segs.Segments()[i]
		s.Segments = append(s.Segments, SegmentStatus{ID: uint32(seg.ID), Size: seg.Alloc.Size(),
			Used: seg.Alloc.Stats().Used, Huge: in.Huge, PageSize: in.PageSize, Locked: in.Locked})
		s.Memory.Hugepages = s.Memory.Hugepages && in.Huge
		s.Memory.PageSize = max(s.Memory.PageSize, in.PageSize)
		if in.Locked {
			s.Memory.LockedBytes += in.Size
		}
		if in.Huge {
			s.Memory.HugeBytes += in.Size
		}
		s.Memory.ReservedPages += in.ReservedPages
		s.Memory.PrefaultMS += float64(in.Prefault.Microseconds()) / 1000
		s.Memory.Warnings = append(s.Memory.Warnings, in.Warnings...)
	}
	return s
}

// storeCollector exports store figures to Prometheus at scrape time.
type storeCollector struct {
	d                                       *daemon
	capacity, used, objects, evictions, pin *prometheus.Desc
	cudaPinned, regs                        *prometheus.Desc
}

func newStoreCollector(d *daemon) *storeCollector {
	return &storeCollector{d: d,
		capacity:  prometheus.NewDesc("mooncake_store_capacity_bytes", "Segment capacity.", nil, nil),
		used:      prometheus.NewDesc("mooncake_store_used_bytes", "Bytes allocated in segments.", nil, nil),
		objects:   prometheus.NewDesc("mooncake_store_objects", "Objects held locally.", nil, nil),
		evictions: prometheus.NewDesc("mooncake_store_evictions_total", "Objects evicted.", nil, nil),
		pin:       prometheus.NewDesc("mooncake_memory_locked_bytes", "Segment bytes locked in memory.", nil, nil),
		cudaPinned: prometheus.NewDesc("mooncake_memory_cuda_pinned_bytes",
			"Segment bytes registered with CUDA (cuMemHostRegister).", nil, nil),
		regs: prometheus.NewDesc("mooncake_registered_buffers", "Client buffers registered now.", nil, nil),
	}
}

func (c *storeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.capacity, c.used, c.objects, c.evictions, c.pin, c.cudaPinned, c.regs} {
		ch <- d
	}
}

func (c *storeCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.d.st.Stats()
	ch <- prometheus.MustNewConstMetric(c.capacity, prometheus.GaugeValue, float64(st.Segments.Size))
	ch <- prometheus.MustNewConstMetric(c.used, prometheus.GaugeValue, float64(st.Segments.Used))
	ch <- prometheus.MustNewConstMetric(c.objects, prometheus.GaugeValue, float64(st.Objects))
	ch <- prometheus.MustNewConstMetric(c.evictions, prometheus.CounterValue, float64(st.Evictions))
	var locked uint64
	for _, r := range c.d.regions {
		if in := r.Info(); in.Locked {
			locked += in.Size
		}
	}
	ch <- prometheus.MustNewConstMetric(c.pin, prometheus.GaugeValue, float64(locked))
	var cudaPinned uint64
	if c.d.cudaPin != nil {
		cudaPinned = c.d.cudaPin.Pinned()
	}
	ch <- prometheus.MustNewConstMetric(c.cudaPinned, prometheus.GaugeValue, float64(cudaPinned))
	live, _, _ := c.d.mnt.Registrations()
	ch <- prometheus.MustNewConstMetric(c.regs, prometheus.GaugeValue, float64(live))
}

// reexecEnv marks a daemon that already re-executed itself.
const reexecEnv = "MOONCAKE_FS_REEXEC"

// reexec starts the daemon again, once, where something it needs is read
// by a process only as it starts:
//
//   - fs.pipe-max-size, raised (as root) so that 1 MiB read replies can be
//     spliced: go-fuse reads the limit once. Without root it changes
//     nothing and the daemon serves reads with writev.
//   - the runtime's madvdontneed, set to 0 (lazyFreeGODEBUG) unless the
//     environment's GODEBUG names it.
//
// A re-execution that fails leaves this process going without them.
func reexec() {
	if os.Getenv(reexecEnv) != "" {
		return
	}
	env, again := os.Environ(), false
	if os.Geteuid() == 0 && !mfs.SpliceReady(mfs.DefaultOptions().MaxWrite) {
		// Raised here or, when daemons start together, by another one:
		// this process read the old limit either way.
		if _, err := mfs.RaisePipeMaxSize(2 * mfs.PipeSizeFor(mfs.DefaultOptions().MaxWrite)); err == nil {
			again = true
		}
	}
	if gd, ok := lazyFreeGODEBUG(os.Getenv("GODEBUG")); ok {
		env = setEnv(env, "GODEBUG", gd)
		again = true
	}
	if !again {
		return
	}
	exe, err := os.Executable()
	if err != nil {
		return
	}
	err = syscall.Exec(exe, os.Args, setEnv(env, reexecEnv, "1"))
	fmt.Fprintf(os.Stderr, "mooncake-fs: re-executing %s: %v (going on without)\n", exe, err)
}

// setEnv returns env with name set to value: a program reads the first
// variable of a name, so every one there goes.
func setEnv(env []string, name, value string) []string {
	env = slices.DeleteFunc(env, func(kv string) bool { return strings.HasPrefix(kv, name+"=") })
	return append(env, name+"="+value)
}

// lazyFreeGODEBUG returns godebug with madvdontneed=0 added, and true,
// when it does not set madvdontneed itself. The runtime then gives the
// pages of heap it frees back to the kernel with MADV_FREE instead of
// MADV_DONTNEED: the kernel takes them only when it needs memory, and a
// page used again before that costs no fault. A daemon's heap churns
// with its keys (every key put allocates its record, every key removed
// or replaced frees one), and with MADV_DONTNEED the pages the
// collector's scavenger had given back were faulted in again by the next
// puts: on the H100 host, 0.17-0.19 faults a key of batch puts at 4
// calls in flight, against 0.015 with MADV_FREE, and 1.98-2.03 us a key
// against 1.44-1.59 (kvprofile -keep 2). The cost: freed heap counts in
// the daemon's resident memory until the kernel takes it back.
func lazyFreeGODEBUG(godebug string) (string, bool) {
	for _, kv := range strings.Split(godebug, ",") {
		if name, _, _ := strings.Cut(strings.TrimSpace(kv), "="); name == "madvdontneed" {
			return godebug, false
		}
	}
	if strings.TrimSpace(godebug) == "" {
		return "madvdontneed=0", true
	}
	return godebug + ",madvdontneed=0", true
}
