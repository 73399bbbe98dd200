package etcdindex

import (
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"

	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"
)

// Options configures New. The zero value of each field means its default.
type Options struct {
	// Endpoints are etcd client URLs ("http://10.0.0.1:2379"). Exactly one
	// of Endpoints and Client must be set.
	Endpoints []string
	// Client is an etcd client the caller made and still owns: Close does
	// not close it. Use it instead of Endpoints for TLS or auth.
	Client *clientv3.Client
	// Prefix is prepended to every etcd key the index uses; objects live
	// under Prefix+"objects/". "" means "/mooncake/". Two indexes share a
	// namespace exactly when they share a prefix.
	Prefix string
	// DialTimeout bounds connecting to etcd. 0 means 5s.
	DialTimeout time.Duration
	// RequestTimeout bounds every etcd request and every wait for the cache
	// to catch up with this process's own writes. 0 means 5s.
	RequestTimeout time.Duration
	// MaxTxnOps is the most swaps one CompareAndSwap may carry; it must not
	// exceed the server's --max-txn-ops. 0 means 128, etcd's default.
	MaxTxnOps int
	// Logger receives the etcd client's log when New makes the client.
	// nil means none: the index returns errors instead of logging them.
	Logger *zap.Logger
}

// DefaultOptions returns the options New uses for zero fields, without
// endpoints.
func DefaultOptions() Options {
	return Options{
		Prefix:         "/mooncake/",
		DialTimeout:    5 * time.Second,
		RequestTimeout: 5 * time.Second,
		MaxTxnOps:      128,
	}
}

// withDefaults fills zero fields from DefaultOptions.
func (o Options) withDefaults() Options {
	d := DefaultOptions()
	if o.Prefix == "" {
		o.Prefix = d.Prefix
	}
	if o.DialTimeout == 0 {
		o.DialTimeout = d.DialTimeout
	}
	if o.RequestTimeout == 0 {
		o.RequestTimeout = d.RequestTimeout
	}
	if o.MaxTxnOps == 0 {
		o.MaxTxnOps = d.MaxTxnOps
	}
	return o
}

// Validate reports every bad field at once.
func (o Options) Validate() error {
	var errs []error
	switch {
	case len(o.Endpoints) == 0 && o.Client == nil:
		errs = append(errs, errors.New("etcdindex: no Endpoints and no Client"))
	case len(o.Endpoints) > 0 && o.Client != nil:
		errs = append(errs, errors.New("etcdindex: both Endpoints and Client set"))
	}
	for i, e := range o.Endpoints {
		if e == "" {
			errs = append(errs, fmt.Errorf("etcdindex: Endpoints[%d] is empty", i))
		}
	}
	if o.DialTimeout < 0 {
		errs = append(errs, fmt.Errorf("etcdindex: DialTimeout %v < 0", o.DialTimeout))
	}
	if o.RequestTimeout < 0 {
		errs = append(errs, fmt.Errorf("etcdindex: RequestTimeout %v < 0", o.RequestTimeout))
	}
	if o.MaxTxnOps < 0 {
		errs = append(errs, fmt.Errorf("etcdindex: MaxTxnOps %d < 0", o.MaxTxnOps))
	}
	return errors.Join(errs...)
}

// NewClient connects an etcd client the way the index wants it: besides
// the endpoints and dial timeout, reconnection backs off to at most one
// second, so a daemon is back within a second of etcd returning from an
// outage (gRPC's default backoff grows to two minutes).
func NewClient(endpoints []string, dialTimeout time.Duration, lg *zap.Logger) (*clientv3.Client, error) {
	if lg == nil {
		lg = zap.NewNop()
	}
	return clientv3.New(clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: dialTimeout,
		Logger:      lg,
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: 2 * time.Second,
		})},
	})
}
