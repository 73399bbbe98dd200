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
		lat, ping := make([]int64, len(keys)), make([]int64, len(keys))
		pass := func(put, timed bool) error {
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
					return err
				}
				if n != opValueSize {
					return fmt.Errorf("get %s: %d B, want %d", k, n, opValueSize)
				}
				if !timed {
					continue
				}
				lat[i] = time.Since(s).Nanoseconds()
				s = time.Now()
				if err := d.Ping(); err != nil {
					return err
				}
				ping[i] = time.Since(s).Nanoseconds()
			}
			return nil
		}
		err = pass(true, put)
		if err == nil && !put {
			err = pass(false, true)
			if err == nil && !bytes.Equal(rbuf, wbuf) {
				err = fmt.Errorf("get: the values read back differ")
			}
		}
		if err != nil {
			return benchSample{}, err
		}
		sum := func(ns []int64) (t int64) {
			for _, v := range ns {
				t += v
			}
			return t
		}
		s := benchSample{Bytes: uint64(len(keys)) * opValueSize, Ns: sum(lat), Ops: len(keys)}
		c := benchSample{Ns: sum(ping), Ops: len(ping)}
		s.P50ns, s.P99ns = percentiles(lat)
		c.P50ns, c.P99ns = percentiles(ping)
		s.Ceiling = &c
		if err := removeSmall(sub, keys); err != nil {
			return benchSample{}, err
		}
		return s, nil
	}
}
