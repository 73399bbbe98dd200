package main

import (
	"bytes"
	"fmt"
	"time"
)

// One-key cases: op-put-4KiB puts p.Files new keys of 4 KiB, op-get-4KiB
// gets them back (put untimed first), one call per key through a
// directory handle kept open, the way a client that keeps its directory
// open does; each call is timed. The ceiling, measured by the same
// process right after, is as many bare round trips through the mount:
// GET_MAGIC on the same handle.

const opValueSize = 4 << 10

func opCases() []benchCase {
	return []benchCase{
		{name: "op-put-4KiB", target: withCopy, ceiling: "ioctl-roundtrip", small: true, run: opRun(true)},
		{name: "op-get-4KiB", target: withCopy, ceiling: "ioctl-roundtrip", small: true, run: opRun(false)},
	}
}

func opRun(put bool) func(dir string, p benchParams) (benchSample, error) {
	return func(dir string, p benchParams) (benchSample, error) {
		sub, d, err := openSmallDir(dir, "op", p.Rep)
		if err != nil {
			return benchSample{}, err
		}
		defer d.Close()
		wbuf, err := newBenchBuf(opValueSize)
		if err != nil {
			return benchSample{}, err
		}
		defer wbuf.free()
		rbuf, err := newBenchBuf(opValueSize)
		if err != nil {
			return benchSample{}, err
		}
		defer rbuf.free()
		keys := smallNames(p.Files)
		lat := make([]int64, len(keys))
		pass := func(put, timed bool) (time.Duration, error) {
			t0 := time.Now()
			for i, k := range keys {
				s := time.Now()
				var n uint64
				var err error
				if put {
					_, err = d.PutKey(k, wbuf, 0)
					n = opValueSize
				} else {
					n, _, err = d.GetKey(k, rbuf, 0)
				}
				if err != nil {
					return 0, err
				}
				if n != opValueSize {
					return 0, fmt.Errorf("get %s: %d B, want %d", k, n, opValueSize)
				}
				if timed {
					lat[i] = time.Since(s).Nanoseconds()
				}
			}
			return time.Since(t0), nil
		}
		elapsed, err := pass(true, put)
		if err == nil && !put {
			elapsed, err = pass(false, true)
			if err == nil && !bytes.Equal(rbuf, wbuf) {
				err = fmt.Errorf("get: the values read back differ")
			}
		}
		if err != nil {
			return benchSample{}, err
		}
		p50, p99 := percentiles(lat)
		s := benchSample{Bytes: uint64(len(keys)) * opValueSize, Ns: elapsed.Nanoseconds(), Ops: len(keys), P50ns: p50, P99ns: p99}
		// The ceiling: as many bare round trips on the same handle.
		t0 := time.Now()
		for i := range lat {
			s := time.Now()
			if err := d.Ping(); err != nil {
				return benchSample{}, err
			}
			lat[i] = time.Since(s).Nanoseconds()
		}
		c := benchSample{Ns: time.Since(t0).Nanoseconds(), Ops: len(lat)}
		c.P50ns, c.P99ns = percentiles(lat)
		s.Ceiling = &c
		if err := removeSmall(sub, keys); err != nil {
			return benchSample{}, err
		}
		return s, nil
	}
}
