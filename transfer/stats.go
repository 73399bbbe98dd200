package transfer

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Path names a strategy in statistics and metrics.
type Path string

const (
	pathLocal     Path = "local-memcpy"
	pathProcessVM Path = "process-vm"
	pathCUDA      Path = "cuda"
	pathTCP       Path = "tcp"
)

// pathID indexes the paths in counters.
type pathID uint8

const (
	idMemcpy pathID = iota
	idProcessVM
	idCUDA
	idTCP
	idRDMADirect
	idRDMAStaged
	nPaths
)

var pathNames = [nPaths]Path{pathLocal, pathProcessVM, pathCUDA, pathTCP, pathRDMADirect, pathRDMAStaged}

// PathStats are one path's counters: bytes moved out of segments (Read)
// and into them (Written), and of those, the bytes this node's CPU or a
// DMA engine copied (a NIC's transfer is no local copy).
type PathStats struct {
	Read          uint64 `json:"read"`
	Written       uint64 `json:"written"`
	CopiedRead    uint64 `json:"copied_read"`
	CopiedWritten uint64 `json:"copied_written"`
	Requests      uint64 `json:"requests"`
}

// Bytes is the bytes moved both ways.
func (p PathStats) Bytes() uint64 { return p.Read + p.Written }

// Copied is the bytes copied both ways.
func (p PathStats) Copied() uint64 { return p.CopiedRead + p.CopiedWritten }

type pathCounters struct{ read, written, copiedRead, copiedWritten, requests atomic.Uint64 }

func (c *pathCounters) add(rd, wr, crd, cwr uint64, n int) {
	c.read.Add(rd)
	c.written.Add(wr)
	c.copiedRead.Add(crd)
	c.copiedWritten.Add(cwr)
	c.requests.Add(uint64(n))
}

// Stats are cumulative counters since the engine started.
type Stats struct {
	// BytesRead and BytesWritten count bytes moved out of and into segments.
	BytesRead, BytesWritten uint64
	// Copies counts passes over the bytes: one per byte moved by memcpy.
	// CopiedBytes/(BytesRead+BytesWritten) is the copies-per-byte figure.
	CopiedBytes uint64
	Requests    uint64
	// GPUPieces counts requests against GPU memory, GPUCopies the copies
	// issued for them: neighbouring pieces merge into one copy.
	GPUPieces, GPUCopies uint64
	// Paths has the counters of each path that moved something: a local
	// copy per byte for memcpy, process-vm, cuda, tcp (the kernel's
	// socket copy) and rdma-staged; none for rdma-direct.
	Paths map[Path]PathStats
}

type statsCounters struct {
	read, written, copied, requests atomic.Uint64
	gpuPieces, gpuCopies            atomic.Uint64
	paths                           [nPaths]pathCounters
}

// Stats returns the counters.
func (e *Engine) Stats() Stats {
	return Stats{
		BytesRead:    e.stats.read.Load(),
		BytesWritten: e.stats.written.Load(),
		CopiedBytes:  e.stats.copied.Load(),
		Requests:     e.stats.requests.Load(),
		GPUPieces:    e.stats.gpuPieces.Load(),
		GPUCopies:    e.stats.gpuCopies.Load(),
		Paths:        e.pathStats(),
	}
}

func (e *Engine) pathStats() map[Path]PathStats {
	var m map[Path]PathStats
	for i := range e.stats.paths {
		c := &e.stats.paths[i]
		if n := c.requests.Load(); n > 0 {
			if m == nil {
				m = map[Path]PathStats{}
			}
			m[pathNames[i]] = PathStats{Read: c.read.Load(), Written: c.written.Load(),
				CopiedRead: c.copiedRead.Load(), CopiedWritten: c.copiedWritten.Load(), Requests: n}
		}
	}
	return m
}

type metrics struct {
	bytes   *prometheus.CounterVec
	copies  *prometheus.CounterVec
	latency *prometheus.HistogramVec
	paths   sync.Map // Path -> *pathMetrics, resolved once per path
}

type pathMetrics struct {
	read, written, copied prometheus.Counter
	latency               prometheus.Observer
}

func (m *metrics) path(p Path) *pathMetrics {
	if v, ok := m.paths.Load(p); ok {
		return v.(*pathMetrics)
	}
	pm := &pathMetrics{
		read:    m.bytes.WithLabelValues(string(p), "read"),
		written: m.bytes.WithLabelValues(string(p), "write"),
		copied:  m.copies.WithLabelValues(string(p)),
		latency: m.latency.WithLabelValues(string(p)),
	}
	v, _ := m.paths.LoadOrStore(p, pm)
	return v.(*pathMetrics)
}

func newMetrics(r prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_transfer_bytes_total",
			Help: "Bytes moved between buffers and segments, by path and direction.",
		}, []string{"path", "op"}),
		copies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_transfer_copied_bytes_total",
			Help: "Bytes copied by the CPU or a DMA engine, by path; divide by bytes_total for copies per byte.",
		}, []string{"path"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "mooncake_transfer_batch_seconds",
			Help:    "Latency of one Submit batch, by path.",
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 12),
		}, []string{"path"}),
	}
	if r != nil {
		for _, c := range []prometheus.Collector{m.bytes, m.copies, m.latency} {
			if err := r.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

func (e *Engine) account(id pathID, reqs []Request, kind Kind, copied uint64, n int, d time.Duration) {
	var rd, wr uint64
	for _, r := range reqs {
		if group(r.Buf.Kind) != group(kind) || (r.Node != "" && r.Node != e.opts.Self) {
			continue
		}
		if r.Op == Read {
			rd += r.Extent.Len
		} else {
			wr += r.Extent.Len
		}
	}
	e.stats.read.Add(rd)
	e.stats.written.Add(wr)
	e.stats.copied.Add(copied)
	e.stats.requests.Add(uint64(n))
	// Local paths copy every byte they move once.
	e.stats.paths[id].add(rd, wr, rd, wr, n)
	pm := e.metrics.path(pathNames[id])
	if rd > 0 {
		pm.read.Add(float64(rd))
	}
	if wr > 0 {
		pm.written.Add(float64(wr))
	}
	pm.copied.Add(float64(copied))
	pm.latency.Observe(d.Seconds())
}

// group folds the kinds that share a strategy.
func group(k Kind) Kind {
	if k == Registered {
		return Host
	}
	return k
}
