// Command ioctlclient drives the data-path ioctls of a mooncake-fs mount
// through package ioctl, as a separate process: the end-to-end tests run
// it so that the test binary never does I/O on a mount.
//
// Every result is one JSON line on stdout:
//
//	{"step":"put_vm","ok":true,"n":1048699,"version":3}
//	{"step":"stale_id","ok":false,"errno":"EINVAL","detail":"..."}
//
// A scenario that checks data itself reports a mismatch as ok=false with
// errno "MISMATCH". The exit status is 0 whenever the scenario ran to its
// end, whatever the steps answered: the test judges the steps.
//
// Usage:
//
//	ioctlclient roundtrip DIR
//	ioctlclient put [--excl] [--buf] [--wait] PATH LOCAL
//	ioctlclient get [--buf] [--rw] [--off N] [--len N] [--into FILE] PATH LOCAL
//	ioctlclient batch-put DIR KEY...
//	ioctlclient batch-get DIR KEY...
//	ioctlclient hold DIR
//	ioctlclient pools DIR N
//	ioctlclient badinput DIR
//	ioctlclient shrink DIR
//	ioctlclient stress DIR ID ITERS
//	ioctlclient mapped DIR
//	ioctlclient mapped-update DIR
//	ioctlclient put-then-stat DIR
//	ioctlclient mapped-close-thread DIR
package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

type result struct {
	Step    string `json:"step"`
	OK      bool   `json:"ok"`
	Errno   string `json:"errno,omitempty"`
	N       uint64 `json:"n"`
	Version uint64 `json:"version,omitempty"`
	Detail  string `json:"detail,omitempty"`
}

var errMismatch = errors.New("MISMATCH")

// emit prints one step: its error's errno (or MISMATCH, or ERROR for
// anything else), or ok.
func emit(step string, n, version uint64, err error) {
	r := result{Step: step, OK: err == nil, N: n, Version: version}
	if err != nil {
		r.Detail = err.Error()
		var e unix.Errno
		switch {
		case errors.Is(err, errMismatch):
			r.Errno = "MISMATCH"
		case errors.As(err, &e):
			r.Errno = unix.ErrnoName(e)
		default:
			r.Errno = "ERROR"
		}
	}
	b, _ := json.Marshal(r)
	fmt.Println(string(b))
}

func mismatch(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errMismatch, fmt.Sprintf(format, args...))
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "ioctlclient:", err)
	os.Exit(1)
}

func main() {
	if len(os.Args) < 2 {
		fatal(errors.New("usage: ioctlclient SCENARIO ARGS"))
	}
	args := os.Args[2:]
	need := func(n int) {
		if len(args) < n {
			fatal(fmt.Errorf("%s: want %d arguments, got %q", os.Args[1], n, args))
		}
	}
	switch os.Args[1] {
	case "roundtrip":
		need(1)
		roundtrip(args[0])
	case "put":
		put(args)
	case "get":
		get(args)
	case "batch-put":
		need(2)
		batchPut(args[0], args[1:])
	case "batch-get":
		need(2)
		batchGet(args[0], args[1:])
	case "batch-order":
		need(1)
		batchOrder(args[0])
	case "hold":
		need(1)
		hold(args[0])
	case "pools":
		need(2)
		n, err := strconv.Atoi(args[1])
		if err != nil {
			fatal(err)
		}
		pools(args[0], n)
	case "badinput":
		need(1)
		badInput(args[0])
	case "shrink":
		need(1)
		shrink(args[0])
	case "stress":
		need(3)
		id, err1 := strconv.Atoi(args[1])
		iters, err2 := strconv.Atoi(args[2])
		if err := errors.Join(err1, err2); err != nil {
			fatal(err)
		}
		stress(args[0], id, iters)
	case "mapped":
		need(1)
		mapped(args[0])
	case "mapped-update":
		need(1)
		mappedUpdate(args[0])
	case "put-then-stat":
		need(1)
		putThenStat(args[0])
	case "mapped-close-thread":
		need(1)
		mappedCloseThread(args[0])
	default:
		fatal(fmt.Errorf("unknown scenario %q", os.Args[1]))
	}
}

// randBytes returns n pseudo-random bytes from seed.
func randBytes(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := 0; i < n; i += 8 {
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], r.Uint64())
		copy(b[i:], w[:])
	}
	return b
}

// keyValue is the value batch-put stores for key and batch-get expects.
func keyValue(key string) []byte {
	h := sha256.Sum256([]byte(key))
	return bytes.Repeat(h[:], 1+len(key)*3)
}

// memfd is a sealed-size shared memory file of n bytes, mapped here.
type memfd struct {
	f   *os.File
	mem []byte
}

func newMemfd(n int) (*memfd, error) {
	fd, err := unix.MemfdCreate("ioctlclient", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, err
	}
	if err := unix.Ftruncate(fd, int64(n)); err != nil {
		unix.Close(fd)
		return nil, err
	}
	mem, err := unix.Mmap(fd, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return &memfd{f: os.NewFile(uintptr(fd), "memfd"), mem: mem}, nil
}

func (m *memfd) close() {
	unix.Munmap(m.mem)
	m.f.Close()
}

func must[T any](v T, err error) T {
	if err != nil {
		fatal(err)
	}
	return v
}

// roundtrip runs every command once through package ioctl and checks what
// comes back.
func roundtrip(dir string) {
	path := filepath.Join(dir, "vm")
	f := must(ioctl.Open(path, os.O_RDWR|os.O_CREATE))
	v, err := f.Probe()
	if err == nil && (v.Major != ioctl.ABIMajor || v.Minor != ioctl.ABIMinor) {
		err = mismatch("abi %d.%d", v.Major, v.Minor)
	}
	emit("probe", 0, 0, err)

	data := randBytes(1<<20+123, 1)
	n, v1, err := f.PutVM(data, 0)
	if err == nil && (n != uint64(len(data)) || v1 == 0) {
		err = mismatch("put %d B, version %d", n, v1)
	}
	emit("put_vm", n, v1, err)

	got := make([]byte, len(data)+100)
	n, ver, err := f.GetVM(got, 0)
	if err == nil && (n != uint64(len(data)) || ver != v1 || !bytes.Equal(got[:n], data)) {
		err = mismatch("got %d B of version %d, want %d of %d", n, ver, len(data), v1)
	}
	emit("get_vm", n, ver, err)

	st, err := f.Stat()
	if err == nil && (st.Size != uint64(len(data)) || st.Version != v1 || st.Replicas < 1 || st.Extents < 1 ||
		st.Location == "" || st.Mode != 0o644 || st.Ino == 0 || st.Mtime.IsZero()) {
		err = mismatch("stat %+v", st)
	}
	emit("stat", st.Size, st.Version, err)

	// Registered buffer: put from one range, get into another.
	const bufLen = 4 << 20
	m := must(newMemfd(bufLen))
	reg, err := f.Register(m.f, 0, bufLen)
	emit("register", reg.Len, 0, err)
	data2 := randBytes(1<<20+77, 2)
	copy(m.mem[4096:], data2)
	n, v2, err := f.PutBuf(reg.ID, 4096, uint64(len(data2)), 0, 0)
	if err == nil && (n != uint64(len(data2)) || v2 <= v1) {
		err = mismatch("put %d B, version %d after %d", n, v2, v1)
	}
	emit("put_buf", n, v2, err)
	n, ver, err = f.GetBuf(reg.ID, 2<<20, 2<<20, 0, 0)
	if err == nil && (n != uint64(len(data2)) || ver != v2 || !bytes.Equal(m.mem[2<<20:2<<20+n], data2)) {
		err = mismatch("got %d B of version %d", n, ver)
	}
	emit("get_buf", n, ver, err)

	// FlagUpdate: patch in the middle and append at the end, each a new
	// version with the rest kept.
	want := append([]byte(nil), data2...)
	copy(want[10:], "PATCH")
	_, v3, err := f.PutVMAt([]byte("PATCH"), 10, ioctl.FlagUpdate)
	emit("update", 5, v3, err)
	want = append(want, "TAIL"...)
	_, v4, err := f.PutVMAt([]byte("TAIL"), uint64(len(data2)), ioctl.FlagUpdate)
	emit("update_grow", 4, v4, err)
	got = make([]byte, len(want)+10)
	n, ver, err = f.GetVM(got, 0)
	if err == nil && (ver != v4 || v4 <= v3 || v3 <= v2 || !bytes.Equal(got[:n], want)) {
		err = mismatch("after updates: %d B of version %d (v3 %d, v4 %d)", n, ver, v3, v4)
	}
	emit("update_read", n, ver, err)

	err = f.Unregister(reg.ID)
	emit("unregister", 0, 0, err)
	_, _, err = f.PutBuf(reg.ID, 0, 10, 0, 0)
	emit("use_after_unregister", 0, 0, err)
	m.close()

	// Closing the writable file must not commit anything over the puts.
	if err := f.Close(); err != nil {
		emit("close", 0, 0, err)
	}
	all, ver, err := ioctl.GetAll(path)
	if err == nil && (!bytes.Equal(all, want) || ver != v4) {
		err = mismatch("after close: %d B of version %d, want %d of %d", len(all), ver, len(want), v4)
	}
	emit("after_close", uint64(len(all)), ver, err)

	// Batches through the caller's memory, enough keys for two calls.
	bdir := filepath.Join(dir, "batch")
	if err := os.Mkdir(bdir, 0o755); err != nil {
		fatal(err)
	}
	d := must(ioctl.OpenDir(bdir))
	items := make([]ioctl.BatchItem, 100)
	for i := range items {
		items[i] = ioctl.BatchItem{Key: fmt.Sprintf("k%03d", i), Data: randBytes(i*83, uint64(100+i))}
	}
	emitBatch("batch_put_vm", must(d.BatchPut(items)), nil)
	dst := make([]ioctl.BatchItem, len(items))
	for i := range dst {
		dst[i] = ioctl.BatchItem{Key: items[i].Key, Data: make([]byte, len(items[i].Data)+16)}
	}
	res, err := d.BatchGet(dst)
	if err != nil {
		emit("batch_get_vm", 0, 0, err)
	} else {
		emitBatch("batch_get_vm", res, func(i int) bool { return bytes.Equal(dst[i].Data[:res[i].N], items[i].Data) })
	}

	// The same as BATCH_PUT and BATCH_GET calls of MaxBatch keys (ABI
	// 1.7, what a client of a daemon before table calls sends).
	ioctl.BatchTables = false
	for i := range items {
		items[i].Key = "old-" + items[i].Key
		dst[i].Key, dst[i].Data = items[i].Key, make([]byte, len(items[i].Data)+16)
	}
	emitBatch("batch_put_vm_calls", must(d.BatchPut(items)), nil)
	if res, err = d.BatchGet(dst); err != nil {
		emit("batch_get_vm_calls", 0, 0, err)
	} else {
		emitBatch("batch_get_vm_calls", res, func(i int) bool { return bytes.Equal(dst[i].Data[:res[i].N], items[i].Data) })
	}
	ioctl.BatchTables = true

	// Batches through a buffer registered on the directory.
	m = must(newMemfd(2 << 20))
	reg, err = d.Register(m.f, 0, 2<<20)
	emit("register_dir", reg.Len, 0, err)
	var bitems, bdst []ioctl.BatchItem
	for i := range 70 {
		v := randBytes(1000+i, uint64(200+i))
		off := uint64(i) * 4096
		copy(m.mem[off:], v)
		bitems = append(bitems, ioctl.BatchItem{Key: fmt.Sprintf("b%03d", i), BufOff: off, Len: uint64(len(v))})
		bdst = append(bdst, ioctl.BatchItem{Key: fmt.Sprintf("b%03d", i), BufOff: 1<<20 + off, Len: 4096})
	}
	emitBatch("batch_put_buf", must(d.BatchPutBuf(reg.ID, bitems)), nil)
	res = must(d.BatchGetBuf(reg.ID, bdst))
	emitBatch("batch_get_buf", res, func(i int) bool {
		return res[i].N == bitems[i].Len && bytes.Equal(m.mem[bdst[i].BufOff:bdst[i].BufOff+res[i].N], m.mem[bitems[i].BufOff:bitems[i].BufOff+bitems[i].Len])
	})
	m.close()

	// A pool on the directory serves keys by name (PUT_KEY, GET_KEY).
	p, err := ioctl.NewPool(d, 64<<10, 4, ioctl.DefaultPoolOptions())
	if err != nil {
		emit("pool_dir", 0, 0, err)
	} else {
		l1, l2 := must(p.Lease(context.Background())), must(p.Lease(context.Background()))
		v := randBytes(50000, 7)
		copy(l1.Buf, v)
		pv, err := l1.Put("pooled", len(v), 0)
		if err == nil {
			var n int
			var gv uint64
			n, gv, err = l2.Get("pooled", 0)
			if err == nil && (n != len(v) || gv != pv || !bytes.Equal(l2.Buf[:n], v)) {
				err = mismatch("pool get %d B of version %d", n, gv)
			}
		}
		l1.Return()
		l2.Return()
		st := p.Stats()
		if err == nil && (st.Registrations != 1 || st.Leases != 2 || st.Leased != 0) {
			err = mismatch("pool stats %+v", st)
		}
		if cerr := p.Close(); err == nil {
			err = cerr
		}
		emit("pool_dir", uint64(len(v)), pv, err)
	}
	d.Close()

	// A pool on a file serves its key.
	pf := must(ioctl.Open(filepath.Join(dir, "pooled-file"), os.O_RDWR|os.O_CREATE))
	p, err = ioctl.NewPool(pf, 1<<20, 2, ioctl.PoolOptions{})
	if err != nil {
		emit("pool_file", 0, 0, err)
	} else {
		l := must(p.Lease(context.Background()))
		v := randBytes(1<<20, 8)
		copy(l.Buf, v)
		pv, err := l.Put("", len(v), 0)
		if err == nil {
			clear(l.Buf)
			var n int
			var gv uint64
			n, gv, err = l.Get("", 0)
			if err == nil && (n != len(v) || gv != pv || !bytes.Equal(l.Buf[:n], v)) {
				err = mismatch("pool get %d B of version %d", n, gv)
			}
		}
		l.Return()
		if cerr := p.Close(); err == nil {
			err = cerr
		}
		emit("pool_file", uint64(len(v)), pv, err)
	}
	pf.Close()

	// The one-call helpers.
	cv := randBytes(33333, 9)
	pv, err := ioctl.Put(filepath.Join(dir, "conv"), cv)
	if err == nil {
		buf := make([]byte, 40000)
		var n int
		n, err = ioctl.Get(filepath.Join(dir, "conv"), buf)
		if err == nil && (n != len(cv) || !bytes.Equal(buf[:n], cv)) {
			err = mismatch("get %d B", n)
		}
	}
	emit("convenience", uint64(len(cv)), pv, err)
}

// emitBatch prints a batch as one step: ok when every key succeeded (and
// check, if given, holds for it).
func emitBatch(step string, res []ioctl.BatchResult, check func(i int) bool) {
	var total uint64
	for i, r := range res {
		if r.Err != nil {
			emit(step, uint64(i), 0, r.Err)
			return
		}
		if check != nil && !check(i) {
			emit(step, uint64(i), 0, mismatch("item %d", i))
			return
		}
		total += r.N
	}
	emit(step, total, 0, nil)
}

// put stores LOCAL as PATH.
func put(args []string) {
	fl := flag.NewFlagSet("put", flag.ExitOnError)
	excl := fl.Bool("excl", false, "FlagExcl")
	parents := fl.Bool("parents", false, "FlagParents (refused on a file)")
	buf := fl.Bool("buf", false, "PUT_BUF from a registered memfd instead of PUT_VM")
	wait := fl.Bool("wait", false, "open, print ready, and put after a line on stdin")
	fl.Parse(args)
	if fl.NArg() != 2 {
		fatal(errors.New("put: want PATH LOCAL"))
	}
	data := must(os.ReadFile(fl.Arg(1)))
	f := must(ioctl.Open(fl.Arg(0), os.O_RDWR|os.O_CREATE))
	defer f.Close()
	var flags uint32
	if *excl {
		flags = ioctl.FlagExcl
	}
	if *parents {
		flags |= ioctl.FlagParents
	}
	var m *memfd
	var reg ioctl.Registration
	if *buf {
		m = must(newMemfd(max(len(data), 1)))
		copy(m.mem, data)
		reg = must(f.Register(m.f, 0, uint64(len(m.mem))))
	}
	if *wait {
		fmt.Println("ready")
		if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
			fatal(err)
		}
	}
	var n, v uint64
	var err error
	if *buf {
		n, v, err = f.PutBuf(reg.ID, 0, uint64(len(data)), 0, flags)
	} else {
		n, v, err = f.PutVM(data, flags)
	}
	emit("put", n, v, err)
}

// get reads PATH into LOCAL.
func get(args []string) {
	fl := flag.NewFlagSet("get", flag.ExitOnError)
	buf := fl.Bool("buf", false, "GET_BUF into a registered memfd instead of GET_VM")
	rw := fl.Bool("rw", false, "open PATH read-write (reads the current version)")
	off := fl.Uint64("off", 0, "object offset")
	length := fl.Int64("len", -1, "bytes to ask for; default: to the end")
	into := fl.String("into", "", "GET_VM into a private mapping of this file (a \"mapped\" step first)")
	fl.Parse(args)
	if fl.NArg() != 2 {
		fatal(errors.New("get: want PATH LOCAL"))
	}
	flag := os.O_RDONLY
	if *rw {
		flag = os.O_RDWR
	}
	f := must(ioctl.Open(fl.Arg(0), flag))
	defer f.Close()
	n := *length
	if n < 0 {
		st, err := f.Stat()
		if err != nil {
			emit("get", 0, 0, err)
			return
		}
		n = int64(st.Size) - int64(*off)
		if n < 0 {
			n = 0
		}
	}
	var got, v uint64
	var err error
	var out []byte
	if *buf {
		m := must(newMemfd(int(max(n, 1))))
		reg := must(f.Register(m.f, 0, uint64(len(m.mem))))
		got, v, err = f.GetBuf(reg.ID, 0, uint64(n), *off, 0)
		out = m.mem[:got]
	} else {
		b := make([]byte, n)
		if *into != "" {
			// Untouched here: the daemon's copy is the first to fault
			// on its pages.
			mf := must(os.Open(*into))
			b = must(unix.Mmap(int(mf.Fd()), 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE))
			emit("mapped", uint64(n), 0, nil)
		}
		got, v, err = f.GetVM(b, *off)
		out = b[:got]
	}
	if err == nil {
		err = os.WriteFile(fl.Arg(1), out, 0o644)
	}
	emit("get", got, v, err)
}

func batchPut(dir string, keys []string) {
	d := must(ioctl.OpenDir(dir))
	defer d.Close()
	items := make([]ioctl.BatchItem, len(keys))
	for i, k := range keys {
		items[i] = ioctl.BatchItem{Key: k, Data: keyValue(k)}
	}
	res, err := d.BatchPut(items)
	if err != nil {
		emit("batch", 0, 0, err)
		return
	}
	for i, r := range res {
		emit("key:"+keys[i], r.N, r.Version, r.Err)
	}
}

func batchGet(dir string, keys []string) {
	d := must(ioctl.OpenDir(dir))
	defer d.Close()
	items := make([]ioctl.BatchItem, len(keys))
	for i, k := range keys {
		items[i] = ioctl.BatchItem{Key: k, Data: make([]byte, len(keyValue(k))+8)}
	}
	res, err := d.BatchGet(items)
	if err != nil {
		emit("batch", 0, 0, err)
		return
	}
	for i, r := range res {
		err := r.Err
		if err == nil && !bytes.Equal(items[i].Data[:r.N], keyValue(keys[i])) {
			err = mismatch("key %s: %d B", keys[i], r.N)
		}
		emit("key:"+keys[i], r.N, r.Version, err)
	}
}

// batchOrder puts batches of more calls than one: of distinct keys (their
// calls overlap) and with a key twice, in different calls (they go in
// order: the later value stays), then reads every key back.
func batchOrder(dir string) {
	d := must(ioctl.OpenDir(dir))
	defer d.Close()
	// Every key's value has its own length: a result given to another
	// key shows in its byte count.
	val := func(k string, round int) []byte {
		n, _ := strconv.Atoi(k[2:])
		return fmt.Appendf(nil, "%s round %d %s", k, round, strings.Repeat("x", n%97+round*37))
	}
	var items []ioctl.BatchItem
	for i := range 3*ioctl.MaxBatch + 5 {
		k := fmt.Sprintf("o-%03d", i)
		items = append(items, ioctl.BatchItem{Key: k, Data: val(k, 1)})
	}
	step := func(name string, items []ioctl.BatchItem) {
		res, err := d.BatchPut(items)
		if err == nil {
			err = errors.Join(func() (errs []error) {
				for i, r := range res {
					errs = append(errs, r.Err)
					if r.Err == nil && r.N != uint64(len(items[i].Data)) {
						errs = append(errs, mismatch("%s: %d B put, its value is %d", items[i].Key, r.N, len(items[i].Data)))
					}
				}
				return
			}()...)
		}
		emit(name, uint64(len(res)), 0, err)
	}
	step("distinct", items)
	// Round 2 of every key, and o-007 once more at the end (round 3),
	// calls later: o-007 ends at round 3.
	for i := range items {
		items[i].Data = val(items[i].Key, 2)
	}
	items = append(items, ioctl.BatchItem{Key: "o-007", Data: val("o-007", 3)})
	step("twice", items)
	got := make([]ioctl.BatchItem, len(items)-1)
	for i := range got {
		got[i] = ioctl.BatchItem{Key: items[i].Key, Data: make([]byte, 512)}
	}
	res, err := d.BatchGet(got)
	for i := 0; err == nil && i < len(got); i++ {
		round := 2
		if got[i].Key == "o-007" {
			round = 3
		}
		if err = res[i].Err; err == nil && !bytes.Equal(got[i].Data[:res[i].N], val(got[i].Key, round)) {
			err = mismatch("%s: %q", got[i].Key, got[i].Data[:res[i].N])
		}
	}
	emit("read", uint64(len(res)), 0, err)
}

// hold registers four buffers (two on a file, one on a directory, one pool)
// and waits to be killed.
func hold(dir string) {
	f := must(ioctl.Open(filepath.Join(dir, "held"), os.O_RDWR|os.O_CREATE))
	m1, m2, m3 := must(newMemfd(1<<20)), must(newMemfd(2<<20)), must(newMemfd(1<<20))
	must(f.Register(m1.f, 0, 1<<20))
	must(f.Register(m2.f, 0, 2<<20))
	d := must(ioctl.OpenDir(dir))
	must(d.Register(m3.f, 0, 1<<20))
	pf := must(ioctl.Open(filepath.Join(dir, "held-pool"), os.O_RDWR|os.O_CREATE))
	p := must(ioctl.NewPool(pf, 64<<10, 8, ioctl.PoolOptions{}))
	l := must(p.Lease(context.Background()))
	copy(l.Buf, "leased")
	fmt.Println("ready 4")
	// Wait for the test to kill us; EOF on stdin (the test gone) ends it.
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
}

// pools makes n pools one after another, each used for several leases, and
// reports each pool's own registration count.
func pools(dir string, n int) {
	d := must(ioctl.OpenDir(dir))
	defer d.Close()
	for i := range n {
		owner := d
		key := fmt.Sprintf("pool-%d", i)
		if i%2 == 1 {
			owner = must(ioctl.Open(filepath.Join(dir, key), os.O_RDWR|os.O_CREATE))
			key = ""
		}
		p, err := ioctl.NewPool(owner, 8192, 3, ioctl.PoolOptions{})
		if err != nil {
			emit(fmt.Sprintf("pool%d", i), 0, 0, err)
			continue
		}
		for j := range 10 {
			l := must(p.Lease(context.Background()))
			v := randBytes(100+j, uint64(i*100+j))
			copy(l.Buf, v)
			if _, err = l.Put(key, len(v), 0); err == nil {
				var got int
				got, _, err = l.Get(key, 0)
				if err == nil && !bytes.Equal(l.Buf[:got], v) {
					err = mismatch("pool %d lease %d", i, j)
				}
			}
			l.Return()
			if err != nil {
				break
			}
		}
		if err == nil {
			// Exhaustion fails fast with the fail policy and never
			// registers more memory.
			ls := []*ioctl.Lease{must(p.Lease(context.Background())), must(p.Lease(context.Background())), must(p.Lease(context.Background()))}
			if _, lerr := p.Lease(context.Background()); !errors.Is(lerr, ioctl.ErrPoolExhausted) {
				err = mismatch("fourth lease of three: %v", lerr)
			}
			for _, l := range ls {
				l.Return()
			}
		}
		st := p.Stats()
		if cerr := p.Close(); err == nil {
			err = cerr
		}
		if err == nil && st.Registrations != 1 {
			err = mismatch("pool %d: %d registrations", i, st.Registrations)
		}
		emit(fmt.Sprintf("pool%d", i), uint64(st.Registrations), 0, err)
		if owner != d {
			owner.Close()
		}
	}
}

// badInput makes calls the daemon must refuse; after each, the committed
// value of key k is unchanged.
func badInput(dir string) {
	path := filepath.Join(dir, "k")
	v0 := randBytes(100000, 42)
	ver0, err := ioctl.Put(path, v0)
	if err != nil {
		fatal(err)
	}
	unchanged := func(step string) {
		all, ver, err := ioctl.GetAll(path)
		if err == nil && (ver != ver0 || !bytes.Equal(all, v0)) {
			err = mismatch("%s changed the value: %d B of version %d", step, len(all), ver)
		}
		emit("unchanged:"+step, uint64(len(all)), ver, err)
	}
	f := must(ioctl.Open(path, os.O_RDWR))
	other := must(ioctl.Open(path, os.O_RDWR))
	m := must(newMemfd(1 << 20))
	copy(m.mem, randBytes(1<<20, 43))
	reg := must(f.Register(m.f, 0, 1<<20))

	bad := func(step string, fn func() error) {
		emit(step, 0, 0, fn())
		unchanged(step)
	}
	bad("foreign_id", func() error { _, _, err := other.PutBuf(reg.ID, 0, 4096, 0, 0); return err })
	bad("foreign_id_get", func() error { _, _, err := other.GetBuf(reg.ID, 0, 4096, 0, 0); return err })
	bad("unknown_id", func() error { _, _, err := f.PutBuf(reg.ID+1000, 0, 4096, 0, 0); return err })
	bad("past_buffer", func() error { _, _, err := f.PutBuf(reg.ID, 1<<20-100, 4096, 0, 0); return err })
	bad("past_buffer_get", func() error { _, _, err := f.GetBuf(reg.ID, 1<<20-100, 4096, 0, 0); return err })
	bad("offset_overflow", func() error { _, _, err := f.PutBuf(reg.ID, ^uint64(0)-10, 4096, 0, 0); return err })
	bad("bad_flags", func() error { _, _, err := f.PutBuf(reg.ID, 0, 4096, 0, 1<<7); return err })
	bad("bad_flags_vm", func() error { _, _, err := f.PutVM([]byte("x"), 1<<9); return err })
	bad("get_flags", func() error { _, _, err := f.GetBuf(reg.ID, 0, 4096, 0, ioctl.FlagExcl); return err })
	bad("objoff_without_update", func() error { _, _, err := f.PutVMAt([]byte("x"), 5, 0); return err })
	bad("bad_address", func() error { return putVMRaw(f, 0x1000, 4096) })
	bad("get_bad_address", func() error { return getVMRaw(f, 0x1000, 4096) })
	bad("get_past_end", func() error { _, _, err := f.GetVM(make([]byte, 10), uint64(len(v0))+1); return err })
	bad("register_bad_fd", func() error { _, err := f.RegisterFd(-1, 0, 4096); return err })
	bad("register_closed_fd", func() error { _, err := f.RegisterFd(999, 0, 4096); return err })
	bad("register_zero_len", func() error { _, err := f.Register(m.f, 0, 0); return err })
	bad("register_past_file", func() error { _, err := f.Register(m.f, 0, 2<<20); return err })
	bad("register_unaligned", func() error { _, err := f.Register(m.f, 100, 4096); return err })
	bad("register_not_memfd", func() error {
		pipeR, pipeW := must2(os.Pipe())
		defer pipeR.Close()
		defer pipeW.Close()
		_, err := f.Register(pipeR, 0, 4096)
		return err
	})
	ro := must(ioctl.Open(path, os.O_RDONLY))
	bad("put_readonly", func() error { _, _, err := ro.PutVM([]byte("x"), 0); return err })
	roM := must(newMemfd(4096))
	roReg, err := ro.Register(roM.f, 0, 4096)
	emit("register_readonly", 0, 0, err) // registering on a read-only file is fine
	bad("put_buf_readonly", func() error { _, _, err := ro.PutBuf(roReg.ID, 0, 4096, 0, 0); return err })
	d := must(ioctl.OpenDir(dir))
	bad("put_on_dir", func() error { _, _, err := d.PutVM([]byte("x"), 0); return err })
	bad("batch_on_file", func() error { _, err := f.BatchPut([]ioctl.BatchItem{{Key: "k", Data: []byte("x")}}); return err })
	bad("batch_foreign_id", func() error {
		r, err := d.BatchPutBuf(reg.ID, []ioctl.BatchItem{{Key: "k", Len: 10}})
		if err == nil {
			err = r[0].Err
		}
		return err
	})
	bad("batch_excl_existing", func() error {
		r, err := d.BatchPut([]ioctl.BatchItem{{Key: "k", Data: []byte("x"), Flags: ioctl.FlagExcl}})
		if err == nil {
			err = r[0].Err
		}
		return err
	})
	bad("batch_dotdot", func() error {
		r, err := d.BatchPut([]ioctl.BatchItem{{Key: "../escape", Data: []byte("x")}})
		if err == nil {
			err = r[0].Err
		}
		return err
	})
	bad("batch_absolute", func() error {
		r, err := d.BatchPut([]ioctl.BatchItem{{Key: "/k", Data: []byte("x")}})
		if err == nil {
			err = r[0].Err
		}
		return err
	})
	bad("excl_nonempty", func() error { _, _, err := f.PutVM([]byte("x"), ioctl.FlagExcl); return err })
	// The registration of f still works after all that.
	n, _, err := f.GetBuf(reg.ID, 0, 1<<20, 0, 0)
	if err == nil && (n != uint64(len(v0)) || !bytes.Equal(m.mem[:n], v0)) {
		err = mismatch("good get after bad calls: %d B", n)
	}
	emit("still_works", n, 0, err)
}

func must2[A, B any](a A, b B, err error) (A, B) {
	if err != nil {
		fatal(err)
	}
	return a, b
}

// putVMRaw and getVMRaw issue PUT_VM/GET_VM with an address that is not
// mapped here (package ioctl only takes slices).
func putVMRaw(f *ioctl.File, addr, n uint64) error {
	return rawVM(f, ioctl.CmdPutVM, addr, n)
}

func getVMRaw(f *ioctl.File, addr, n uint64) error {
	return rawVM(f, ioctl.CmdGetVM, addr, n)
}

func rawVM(f *ioctl.File, cmd uint32, addr, n uint64) error {
	a := ioctl.VMArg{Addr: addr, Len: n}
	b := a.Marshal()
	_, _, e := unix.Syscall(unix.SYS_IOCTL, f.OS().Fd(), uintptr(cmd), uintptr(unsafe.Pointer(&b[0])))
	if e != 0 {
		return e
	}
	return nil
}

// shrink registers a memfd and then shrinks it under the daemon: the
// daemon must refuse (or fail) the copy, not die of SIGBUS.
func shrink(dir string) {
	f := must(ioctl.Open(filepath.Join(dir, "shrunk"), os.O_RDWR|os.O_CREATE))
	m := must(newMemfd(1 << 20))
	reg := must(f.Register(m.f, 0, 1<<20))
	// Give the object bytes, so the get below has something to copy.
	if _, _, err := f.PutVM(make([]byte, 1<<20), 0); err != nil {
		fatal(err)
	}
	unix.Munmap(m.mem)
	if err := m.f.Truncate(0); err != nil {
		fatal(err)
	}
	_, _, err := f.PutBuf(reg.ID, 0, 1<<20, 0, 0)
	emit("put_shrunk", 0, 0, err)
	_, _, err = f.GetBuf(reg.ID, 0, 1<<20, 0, 0)
	emit("get_shrunk", 0, 0, err)
}

// stress runs iters rounds of puts and gets of this client's own keys
// (checked exactly) and of a key shared by every client (checked to be
// one whole value of some client).
func stress(dir string, id, iters int) {
	r := rand.New(rand.NewPCG(uint64(id), 7))
	d := must(ioctl.OpenDir(dir))
	defer d.Close()
	p := must(ioctl.NewPool(d, 256<<10, 2, ioctl.DefaultPoolOptions()))
	shared := filepath.Join(dir, "shared")
	ops := uint64(0)
	fail := func(step string, err error) {
		emit(step, ops, 0, err)
		os.Exit(0)
	}
	for it := range iters {
		v := stressValue(id, it, r.IntN(256<<10))
		own := fmt.Sprintf("c%d-%d", id, it%4)
		switch it % 3 {
		case 0: // VM through a file
			f, err := ioctl.Open(filepath.Join(dir, own), os.O_RDWR|os.O_CREATE)
			if err != nil {
				fail("open", err)
			}
			_, _, err = f.PutVM(v, 0)
			f.Close()
			if err != nil {
				fail("put_vm", err)
			}
		case 1: // a pool lease through the directory
			l, err := p.Lease(context.Background())
			if err != nil {
				fail("lease", err)
			}
			copy(l.Buf, v)
			_, err = l.Put(own, len(v), 0)
			l.Return()
			if err != nil {
				fail("lease_put", err)
			}
		case 2: // a VM batch
			res, err := d.BatchPut([]ioctl.BatchItem{{Key: own, Data: v}})
			if err == nil {
				err = res[0].Err
			}
			if err != nil {
				fail("batch_put", err)
			}
		}
		got, _, err := ioctl.GetAll(filepath.Join(dir, own))
		if err != nil {
			fail("get_own", err)
		}
		if !bytes.Equal(got, v) {
			fail("get_own", mismatch("client %d round %d: %d B, want %d", id, it, len(got), len(v)))
		}
		if _, err := ioctl.Put(shared, v); err != nil {
			fail("put_shared", err)
		}
		got, _, err = ioctl.GetAll(shared)
		if err != nil {
			fail("get_shared", err)
		}
		if len(got) < 16 {
			fail("get_shared", mismatch("%d B", len(got)))
		}
		wid, wit := binary.LittleEndian.Uint64(got), binary.LittleEndian.Uint64(got[8:])
		if !bytes.Equal(got, stressValue(int(wid), int(wit), len(got))) {
			fail("get_shared", mismatch("torn value of client %d round %d, %d B", wid, wit, len(got)))
		}
		ops += 4
	}
	if err := p.Close(); err != nil {
		fail("pool_close", err)
	}
	emit("stress", ops, 0, nil)
}

// stressValue is n bytes (at least 16) identifying client id, round it.
func stressValue(id, it, n int) []byte {
	n = max(n, 16)
	v := randBytes(n, uint64(id)<<32|uint64(it))
	binary.LittleEndian.PutUint64(v, uint64(id))
	binary.LittleEndian.PutUint64(v[8:], uint64(it))
	return v
}

// mapped: puts and gets whose process memory is a MAP_SHARED mapping of a
// file of the same mount, so the daemon's copy faults on pages that the
// daemon itself must serve (a READ to fill them, WRITEs of their
// writeback that copy the old value into a draft). One step per case,
// large (copied in chunks) and small, the mapping's pages clean or dirty;
// each checks both files, once the mapping is written back, against a
// model.
func mapped(dir string) {
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	d, err := ioctl.OpenDir(dir)
	if err != nil {
		fatal(err)
	}
	defer d.Close()
	type tcase struct {
		name string
		// run does the call on m, the mapping of a; it returns the
		// files a and b the model wants afterwards.
		run func(fa, fb *ioctl.File, m, va, vb []byte) (wantA, wantB []byte, err error)
	}
	cases := []tcase{
		{"get_self", func(fa, fb *ioctl.File, m, va, vb []byte) ([]byte, []byte, error) {
			_, _, err := fa.GetVM(m, 0)
			return va, vb, err
		}},
		{"put_self", func(fa, fb *ioctl.File, m, va, vb []byte) ([]byte, []byte, error) {
			_, _, err := fa.PutVM(m, 0)
			return va, vb, err
		}},
		{"get_other", func(fa, fb *ioctl.File, m, va, vb []byte) ([]byte, []byte, error) {
			_, _, err := fb.GetVM(m, 0)
			return vb, vb, err
		}},
		{"put_other", func(fa, fb *ioctl.File, m, va, vb []byte) ([]byte, []byte, error) {
			_, _, err := fb.PutVM(m, 0)
			return va, va, err
		}},
		{"get_key", func(fa, fb *ioctl.File, m, va, vb []byte) ([]byte, []byte, error) {
			_, _, err := d.GetKey("a", m, 0)
			return va, vb, err
		}},
		{"put_key", func(fa, fb *ioctl.File, m, va, vb []byte) ([]byte, []byte, error) {
			_, err := d.PutKey("b", m, 0)
			return va, va, err
		}},
		{"batch_get", func(fa, fb *ioctl.File, m, va, vb []byte) ([]byte, []byte, error) {
			h := len(m) / 2
			// a's first half into the first half, b's first half into
			// the second: disjoint, so the order of the copies is free.
			res, err := d.BatchGetV(nil, []ioctl.VItem{{Key: "a", Data: [][]byte{m[:h/2], m[h/2 : h]}}, {Key: "b", Data: [][]byte{m[h:]}}})
			if err == nil {
				err = batchErr(res, uint64(h), uint64(h))
			}
			return append(append([]byte(nil), va[:h]...), vb[:h]...), vb, err
		}},
		{"batch_put", func(fa, fb *ioctl.File, m, va, vb []byte) ([]byte, []byte, error) {
			h := len(m) / 2
			res, err := d.BatchPutV(nil, []ioctl.VItem{{Key: "a", Data: [][]byte{m[:h], m[h:]}}, {Key: "b", Data: [][]byte{m[:h]}}})
			if err == nil {
				err = batchErr(res, uint64(len(m)), uint64(h))
			}
			return va, va[:h], err
		}},
	}
	for _, size := range []int{32 << 20, 1 << 20} {
		for _, dirty := range []bool{false, true} {
			for k, c := range cases {
				step := fmt.Sprintf("%s_%dMiB", c.name, size>>20)
				if dirty {
					step += "_dirty"
				}
				va, vb := randBytes(size, uint64(2*k+1)), randBytes(size, uint64(2*k+2))
				err := mappedCase(a, b, va, vb, dirty, c.run)
				emit(step, uint64(size), 0, err)
			}
		}
	}
}

// batchErr is the first failed key of a batch, or one of a length other
// than want.
func batchErr(res []ioctl.BatchResult, want ...uint64) error {
	for i, r := range res {
		if r.Err != nil {
			return r.Err
		}
		if r.N != want[i] {
			return mismatch("key %d: %d B, want %d", i, r.N, want[i])
		}
	}
	return nil
}

// mappedCase stores va as a and vb as b, maps a, runs call on the
// mapping, writes the mapping back and checks both files.
func mappedCase(a, b string, va, vb []byte, dirty bool, call func(fa, fb *ioctl.File, m, va, vb []byte) ([]byte, []byte, error)) error {
	if err := errors.Join(os.WriteFile(a, va, 0o644), os.WriteFile(b, vb, 0o644)); err != nil {
		return err
	}
	o, err := os.OpenFile(a, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	m, err := unix.Mmap(int(o.Fd()), 0, len(va), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		o.Close()
		return err
	}
	if dirty {
		// Every page dirty, with the bytes it has: writeback may come at
		// any time and leave what the model says.
		for i := 0; i < len(m); i += 4096 {
			m[i] = va[i]
		}
	}
	fa, err1 := ioctl.Open(a, os.O_RDWR)
	fb, err2 := ioctl.Open(b, os.O_RDWR)
	if err := errors.Join(err1, err2); err != nil {
		return err
	}
	wantA, wantB, err := call(fa, fb, m, va, vb)
	// The mapping written back through the open descriptor's close.
	err = errors.Join(err, unix.Munmap(m), o.Close(), fa.Close(), fb.Close())
	if err != nil {
		return err
	}
	for _, f := range []struct {
		path string
		want []byte
	}{{a, wantA}, {b, wantB}} {
		got, err := os.ReadFile(f.path)
		if err != nil {
			return err
		}
		if !bytes.Equal(got, f.want) {
			return mismatch("%s: %d B, want %d (first difference at %d)", f.path, len(got), len(f.want), firstDiff(got, f.want))
		}
	}
	return nil
}

// firstDiff is the first index at which x and y differ.
func firstDiff(x, y []byte) int {
	for i := range min(len(x), len(y)) {
		if x[i] != y[i] {
			return i
		}
	}
	return min(len(x), len(y))
}

// mappedUpdate: updates (FlagUpdate) through an open file whose source is
// a mapping of that same file, while another thread fsyncs and truncates
// it (to its size) in a loop: the update writes into the file's draft,
// which the mapping's faults read and the fsyncs commit. Each update
// copies the second half over the first; the value is checked, through
// the daemon, against the model.
func mappedUpdate(dir string) {
	const size = 32 << 20
	a := filepath.Join(dir, "u")
	va := randBytes(size, 77)
	if err := os.WriteFile(a, va, 0o644); err != nil {
		fatal(err)
	}
	o := must(os.OpenFile(a, os.O_RDWR, 0))
	defer o.Close()
	m := must(unix.Mmap(int(o.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED))
	fa := must(ioctl.Open(a, os.O_RDWR))
	defer fa.Close()
	stop := make(chan struct{})
	racer := make(chan error, 1)
	go func() {
		var err error
		for i := 0; err == nil; i++ {
			select {
			case <-stop:
				racer <- nil
				return
			default:
			}
			if i%2 == 0 {
				err = unix.Fsync(int(o.Fd()))
			} else {
				err = unix.Ftruncate(int(o.Fd()), size)
			}
		}
		racer <- err
	}()
	h := size / 2
	var err error
	for range 4 {
		if _, _, err = fa.PutVMAt(m[h:], 0, ioctl.FlagUpdate); err != nil {
			break
		}
	}
	close(stop)
	err = errors.Join(err, <-racer, unix.Munmap(m))
	if err == nil {
		got := make([]byte, size)
		var n uint64
		n, _, err = fa.GetVM(got, 0)
		want := append(append([]byte(nil), va[h:]...), va[h:]...)
		if err == nil && (n != size || !bytes.Equal(got, want)) {
			err = mismatch("%d B read, first difference at %d", n, firstDiff(got[:n], want))
		}
	}
	emit("update_from_own_mapping", size, 0, err)
}

// putThenStat: a put by name that grows a key the kernel has cached is
// seen whole by the caller's next stat, by PUT_KEY and by BATCH_PUTV: the
// kernel's copy of the key is forgotten before the put returns. One step
// per path, failing with the count of stale sizes.
func putThenStat(dir string) {
	d := must(ioctl.OpenDir(dir))
	defer d.Close()
	small, big := make([]byte, 4096), randBytes(1<<20, 5)
	for _, how := range []string{"put_key", "batch_put", "file_put"} {
		put := func(k string, v []byte) error {
			switch how {
			case "put_key":
				_, err := d.PutKey(k, v, 0)
				return err
			case "file_put":
				// Through a file opened for writing, as a put of a
				// whole new content by PUT_VM.
				f, err := ioctl.Open(filepath.Join(dir, k), os.O_RDWR|os.O_CREATE)
				if err != nil {
					return err
				}
				_, _, err = f.PutVM(v, 0)
				return errors.Join(err, f.Close())
			}
			res, err := d.BatchPutV(nil, []ioctl.VItem{{Key: k, Data: [][]byte{v}}})
			if err == nil {
				err = res[0].Err
			}
			return err
		}
		step := how + "_then_stat"
		var err error
		stale := 0
		const iters = 300
		for it := 0; it < iters && err == nil; it++ {
			k := fmt.Sprintf("st%d", it%8)
			p := filepath.Join(dir, k)
			if err = put(k, small); err != nil {
				break
			}
			if _, err = os.Stat(p); err != nil { // the kernel caches the small size
				break
			}
			if err = put(k, big); err != nil {
				break
			}
			var st os.FileInfo
			if st, err = os.Stat(p); err == nil && st.Size() != int64(len(big)) {
				stale++
			}
		}
		if err == nil && stale > 0 {
			err = mismatch("%d of %d stats after a put saw the old size", stale, iters)
		}
		emit(step, uint64(stale), 0, err)
	}
}

// mappedCloseThread changes files only through a shared mapping, opened
// and written on one OS thread, closed on another, and reads each back
// right after the close: close(2) by any thread of the writer publishes
// (the mapping's writeback names no lock owner).
func mappedCloseThread(dir string) {
	const n, iters = 64 << 10, 300
	closes := make(chan *os.File)
	closed := make(chan error)
	go func() {
		runtime.LockOSThread() // never the opener's thread
		for f := range closes {
			closed <- f.Close()
		}
	}()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	stale := 0
	var err error
	for i := 0; i < iters && err == nil; i++ {
		p := filepath.Join(dir, fmt.Sprintf("mc%d", i%8))
		if i < 8 {
			if err = os.WriteFile(p, make([]byte, n), 0o644); err != nil {
				break
			}
		}
		var f *os.File
		if f, err = os.OpenFile(p, os.O_RDWR, 0); err != nil {
			break
		}
		var m []byte
		if m, err = unix.Mmap(int(f.Fd()), 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err != nil {
			f.Close()
			break
		}
		want := bytes.Repeat([]byte{byte(i%250 + 1)}, n)
		copy(m, want)
		err = unix.Munmap(m)
		closes <- f
		err = errors.Join(err, <-closed)
		var got []byte
		if got, err = os.ReadFile(p); err == nil && !bytes.Equal(got, want) {
			stale++
		}
	}
	close(closes)
	if err == nil && stale > 0 {
		err = mismatch("%d of %d reads right after the close saw the old content", stale, iters)
	}
	emit("mapped_close_thread", uint64(stale), 0, err)
}
