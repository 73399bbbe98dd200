package fs

import (
	"context"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
)

type metrics struct {
	ops    *prometheus.HistogramVec
	errors *prometheus.CounterVec
	bytes  *prometheus.CounterVec
	obs    sync.Map // op -> prometheus.Observer, resolved once per op
}

func (m *metrics) observer(op string) prometheus.Observer {
	if v, ok := m.obs.Load(op); ok {
		return v.(prometheus.Observer)
	}
	v, _ := m.obs.LoadOrStore(op, m.ops.WithLabelValues(op))
	return v.(prometheus.Observer)
}

func newMetrics(r prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		ops: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "mooncake_fs_op_seconds",
			Help:    "Latency of FUSE operations, by operation.",
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 12),
		}, []string{"op"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_fs_op_errors_total",
			Help: "FUSE operations that returned an error, by operation and errno.",
		}, []string{"op", "errno"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mooncake_fs_bytes_total",
			Help: "Bytes moved through read and write requests of the file interface.",
		}, []string{"op"}),
	}
	if r != nil {
		for _, c := range []prometheus.Collector{m.ops, m.errors, m.bytes} {
			if err := r.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

// opDone ends one operation: metrics, and the one debug line per op. err
// is the cause of errno (or nil); unknown causes mapped to EIO are logged
// as errors.
func (f *FS) opDone(ctx context.Context, op, key string, n int, start time.Time, errno syscall.Errno, err error) {
	d := time.Since(start)
	f.metrics.observer(op).Observe(d.Seconds())
	if n > 0 && (op == "read" || op == "write") {
		f.metrics.bytes.WithLabelValues(op).Add(float64(n))
	}
	if errno != 0 {
		f.metrics.errors.WithLabelValues(op, errno.Error()).Inc()
	}
	if (errno == syscall.EIO || errno == syscall.ETIMEDOUT) && err != nil {
		f.log.WithFields(logrus.Fields{"op": op, "key": key}).WithError(err).Error("I/O error")
	}
	if f.log.IsLevelEnabled(logrus.DebugLevel) {
		e := f.log.WithFields(logrus.Fields{"op": op, "key": key, "bytes": n, "errno": int(errno), "us": d.Microseconds()})
		if err != nil {
			e = e.WithError(err)
		}
		e.Debug("fs op")
	}
}
