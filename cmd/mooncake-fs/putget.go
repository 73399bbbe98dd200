package main

// put and get move one value between a local file and a key with the
// data-path ioctls: each byte is copied once into or out of the store.
//
//	put: a regular source file is mapped and stored with one PUT_VM, which
//	     copies from the page cache straight into the store. Any other
//	     source (a pipe, "-" for stdin, a file on a mooncake-fs mount) is
//	     read into a memfd that is registered once and stored with one
//	     PUT_BUF.
//	get: the key is opened read-only, so every read sees the version
//	     current at open; a regular destination is sized (fallocate,
//	     ftruncate), mapped, and filled by GET_VM 64 MiB at a time;
//	     anything else ("-" for stdout, a file on a mooncake-fs mount)
//	     gets the chunks through a staging buffer and write(2). The value
//	     ends where a read comes back short: STAT's size is only a hint,
//	     as it describes the key's current version.
//
// Progress (on a terminal, for values of 64 MiB or more and for streams)
// shows only work that really comes in pieces. A put must become visible
// atomically, and FlagUpdate chunks would each commit a new version,
// copying the value again every time, so a put is one ioctl: its bar
// covers faulting the source in (MADV_POPULATE_READ, which reads it from
// disk when it is not cached) or reading the stream, and a spinner runs
// during the single store call. A get is chunked for real: its bar moves
// per GET_VM.
//
// Files on a mooncake-fs mount are never mapped for the daemon to copy
// into or out of: its process_vm_readv/writev would fault on its own
// mount.

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

const (
	// transferChunk is the bytes per GET_VM of get, per read of a
	// streamed put, and per MADV_POPULATE_READ of a mapped put.
	transferChunk = 64 << 20
	// progressMin is the smallest file that gets a bar with --progress auto.
	progressMin = 64 << 20
)

type putGetFlags struct {
	progress string
	excl     bool
}

func parsePutGet(cmd, usage string, args []string, withExcl bool) (*putGetFlags, []string, error) {
	c := &putGetFlags{}
	fl := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fl.Usage = func() {
		fmt.Fprintf(fl.Output(), "usage: mooncake-fs %s\n", usage)
		fl.PrintDefaults()
	}
	fl.StringVar(&c.progress, "progress", "auto", "auto (on a terminal, values >= 64 MiB), always or never")
	if withExcl {
		fl.BoolVar(&c.excl, "excl", false, "fail with EEXIST unless KEYPATH is new or empty (first writer wins)")
	}
	if err := fl.Parse(args); err != nil {
		return nil, nil, err
	}
	var errs []error
	if fl.NArg() != 2 {
		errs = append(errs, fmt.Errorf("want 2 arguments (%s), got %q", usage, fl.Args()))
	}
	switch c.progress {
	case "auto", "always", "never":
	default:
		errs = append(errs, fmt.Errorf("--progress %q: want auto, always or never", c.progress))
	}
	return c, fl.Args(), errors.Join(errs...)
}

func runPut(args []string) error {
	c, a, err := parsePutGet("put", "put [--excl] [--progress MODE] FILE KEYPATH", args, true)
	if err != nil {
		return err
	}
	src, keypath := a[0], a[1]
	// Probe the directory first, so that nothing is created outside a
	// mount.
	if err := probeDir(filepath.Dir(keypath)); err != nil {
		return err
	}
	in, st, err := openInput(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := ioctl.Open(keypath, os.O_RDWR|os.O_CREATE)
	if err != nil {
		return err
	}
	defer out.Close()
	var flags uint32
	if c.excl {
		flags |= ioctl.FlagExcl
	}
	size := int64(-1)
	if st.Mode().IsRegular() {
		size = st.Size()
	}
	p := newProgress(c.progress, size, "put "+keypath)
	defer p.finish()
	var n uint64
	if size > 0 && !onMooncake(in) {
		n, err = putMapped(out, in, size, flags, p)
	} else {
		n, err = putStaged(out, in, size, flags, p)
	}
	if err != nil {
		return err
	}
	if size >= 0 && n != uint64(size) {
		return fmt.Errorf("%s: stored %d B of %d", keypath, n, size)
	}
	return out.Close()
}

// putMapped stores the regular file in with one PUT_VM from a mapping of
// it: one copy, page cache to store.
func putMapped(out *ioctl.File, in *os.File, size int64, flags uint32, p *progress) (uint64, error) {
	if int64(int(size)) != size {
		return 0, fmt.Errorf("%s: %d B does not fit in memory", in.Name(), size)
	}
	m, err := unix.Mmap(int(in.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return 0, fmt.Errorf("mmap %s: %w", in.Name(), err)
	}
	defer unix.Munmap(m)
	for off := 0; off < len(m); off += transferChunk {
		end := min(off+transferChunk, len(m))
		if err := populate(m[off:end]); err != nil {
			return 0, fmt.Errorf("read %s at %d: %w", in.Name(), off, err)
		}
		p.add(end - off)
	}
	p.spin("store " + out.Name())
	n, _, err := out.PutVM(m, flags)
	return n, err
}

// populate faults b in for reading, from disk if need be, without
// touching it byte by byte where the kernel can do it.
func populate(b []byte) error {
	err := unix.Madvise(b, unix.MADV_POPULATE_READ)
	if err != unix.EINVAL && err != unix.ENOSYS {
		return err
	}
	pg := os.Getpagesize()
	var sink byte
	for i := 0; i < len(b); i += pg {
		sink += b[i]
	}
	_ = sink
	return nil
}

// putStaged reads in (any kind of file) into a memfd, registers it once on
// out and stores it with one PUT_BUF.
func putStaged(out *ioctl.File, in *os.File, size int64, flags uint32, p *progress) (uint64, error) {
	fd, err := unix.MemfdCreate("mooncake-put", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return 0, fmt.Errorf("memfd_create: %w", err)
	}
	mem := os.NewFile(uintptr(fd), "mooncake-put")
	defer mem.Close()
	buf := make([]byte, 4<<20)
	var total int64
	for {
		k, rerr := in.Read(buf)
		if k > 0 {
			if _, err := mem.Write(buf[:k]); err != nil {
				return 0, fmt.Errorf("stage %s: %w", in.Name(), err)
			}
			total += int64(k)
			p.add(k)
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return 0, fmt.Errorf("read %s: %w", in.Name(), rerr)
		}
	}
	if size >= 0 && total != size {
		return 0, fmt.Errorf("read %s: %d B, but it has %d", in.Name(), total, size)
	}
	p.spin("store " + out.Name())
	if total == 0 {
		n, _, err := out.PutVM(nil, flags)
		return n, err
	}
	// Sealed size: the daemon's mapping can never lose pages under it.
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
		return 0, fmt.Errorf("seal memfd: %w", err)
	}
	reg, err := out.Register(mem, 0, uint64(total))
	if err != nil {
		return 0, err
	}
	// The registration dies when out is closed.
	n, _, err := out.PutBuf(reg.ID, 0, uint64(total), 0, flags)
	return n, err
}

func runGet(args []string) error {
	c, a, err := parsePutGet("get", "get [--progress MODE] KEYPATH FILE", args, false)
	if err != nil {
		return err
	}
	keypath, dst := a[0], a[1]
	// Read-only: every chunk reads the version current at this open.
	in, err := ioctl.Open(keypath, os.O_RDONLY)
	if err != nil {
		return err
	}
	defer in.Close()
	if _, err := in.Probe(); err != nil {
		return err
	}
	st, err := in.Stat()
	if err != nil {
		return err
	}
	var out *os.File
	if dst == "-" {
		out = os.Stdout
	} else if out, err = os.OpenFile(dst, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644); err != nil {
		return err
	} else {
		defer out.Close()
	}
	ost, err := out.Stat()
	if err != nil {
		return err
	}
	// Standard output may be a regular file opened write-only or for
	// appending: it is never mapped.
	var sink getSink = &stagedSink{out: out}
	if dst != "-" && ost.Mode().IsRegular() && !onMooncake(out) {
		sink = &mappedSink{out: out, hint: int64(st.Size)}
	}
	p := newProgress(c.progress, int64(st.Size), "get "+keypath)
	defer p.finish()
	size, err := getValue(in, int64(st.Size), p, sink)
	if ferr := sink.finish(size); err == nil {
		err = ferr
	}
	if err != nil {
		return err
	}
	if out != os.Stdout {
		return out.Close()
	}
	return nil
}

// getValue reads the whole value of in with GET_VM, transferChunk at a
// time, into sink, and returns its size. hint is the size STAT reported:
// STAT describes the key's current version, which may be newer than the
// one this read-only open reads, so the end of the value is where a read
// comes back short, and a one-byte read past hint confirms it.
func getValue(in *ioctl.File, hint int64, p *progress, sink getSink) (int64, error) {
	var off int64
	var version uint64
	check := func(v uint64) error {
		if off == 0 {
			version = v
		}
		if v != version {
			return fmt.Errorf("%s: version %d after %d through one read-only open", in.Name(), v, version)
		}
		return nil
	}
	for {
		if off >= hint {
			var one [1]byte
			n, v, err := in.GetVM(one[:], uint64(off))
			if err != nil {
				return off, err
			}
			if err := check(v); err != nil {
				return off, err
			}
			if n == 0 {
				return off, nil
			}
			hint = off + transferChunk
			p.grow(hint)
		}
		want := int(min(transferChunk, hint-off))
		b, err := sink.buf(off, want)
		if err != nil {
			return off, err
		}
		n, v, err := in.GetVM(b, uint64(off))
		if err != nil {
			return off, err
		}
		if err := check(v); err != nil {
			return off, err
		}
		if err := sink.filled(b[:n]); err != nil {
			return off, err
		}
		off += int64(n)
		p.add(int(n))
		if int(n) < want {
			return off, nil
		}
	}
}

// getSink is where get puts the value.
type getSink interface {
	// buf returns the n bytes at value offset off, for GET_VM to fill.
	buf(off int64, n int) ([]byte, error)
	// filled takes the bytes buf returned, as filled.
	filled(b []byte) error
	// finish ends the value at size bytes.
	finish(size int64) error
}

// mappedSink fills a shared mapping of the regular file out: one copy,
// store to page cache.
type mappedSink struct {
	out  *os.File
	hint int64 // the expected size: the first mapping covers it all
	m    []byte
}

func (s *mappedSink) buf(off int64, n int) ([]byte, error) {
	end := off + int64(n)
	if end > int64(len(s.m)) {
		if err := s.grow(max(end, s.hint)); err != nil {
			return nil, err
		}
	}
	return s.m[off:end], nil
}

// grow sizes the file to size bytes and maps all of it.
func (s *mappedSink) grow(size int64) error {
	if int64(int(size)) != size {
		return fmt.Errorf("%s: %d B does not fit in memory", s.out.Name(), size)
	}
	fd := int(s.out.Fd())
	// Reserve the space first: a full file system then fails here with
	// ENOSPC, not in the daemon's copy with EFAULT.
	if err := unix.Fallocate(fd, 0, 0, size); err != nil && err != unix.EOPNOTSUPP {
		return fmt.Errorf("allocate %d B for %s: %w", size, s.out.Name(), err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		return fmt.Errorf("truncate %s to %d B: %w", s.out.Name(), size, err)
	}
	if s.m != nil {
		if err := unix.Munmap(s.m); err != nil {
			return fmt.Errorf("munmap %s: %w", s.out.Name(), err)
		}
		s.m = nil
	}
	m, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("mmap %s: %w", s.out.Name(), err)
	}
	s.m = m
	return nil
}

func (s *mappedSink) filled([]byte) error { return nil }

func (s *mappedSink) finish(size int64) error {
	var errs []error
	if s.m != nil {
		if err := unix.Munmap(s.m); err != nil {
			errs = append(errs, fmt.Errorf("munmap %s: %w", s.out.Name(), err))
		}
		s.m = nil
	}
	if err := unix.Ftruncate(int(s.out.Fd()), size); err != nil {
		errs = append(errs, fmt.Errorf("truncate %s to %d B: %w", s.out.Name(), size, err))
	}
	return errors.Join(errs...)
}

// stagedSink reads each chunk into one staging buffer and writes it to
// out: for standard output and files that cannot be mapped.
type stagedSink struct {
	out *os.File
	b   []byte
}

func (s *stagedSink) buf(_ int64, n int) ([]byte, error) {
	if len(s.b) < n {
		s.b = make([]byte, n)
	}
	return s.b[:n], nil
}

func (s *stagedSink) filled(b []byte) error {
	if _, err := s.out.Write(b); err != nil {
		return fmt.Errorf("write %s: %w", s.out.Name(), err)
	}
	return nil
}

func (s *stagedSink) finish(int64) error { return nil }

// openInput opens a put's source; "-" is stdin.
func openInput(src string) (*os.File, os.FileInfo, error) {
	f := os.Stdin
	if src != "-" {
		var err error
		if f, err = os.Open(src); err != nil {
			return nil, nil, err
		}
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	if st.IsDir() {
		f.Close()
		return nil, nil, fmt.Errorf("%s is a directory", src)
	}
	return f, st, nil
}

// probeDir fails unless dir is on a mooncake-fs mount.
func probeDir(dir string) error {
	d, err := ioctl.OpenDir(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	_, err = d.Probe()
	return err
}

// onMooncake reports whether the regular file f is on a mooncake-fs
// mount: FUSE, and the daemon answers GET_MAGIC.
func onMooncake(f *os.File) bool {
	var s unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &s); err != nil || s.Type != unix.FUSE_SUPER_MAGIC {
		return false
	}
	_, err := ioctl.Probe(f)
	return err == nil
}

// progress is a bar on stderr, or nothing.
type progress struct {
	bar *progressbar.ProgressBar // nil: not shown
	on  bool                     // bar is on the current line
}

func newProgress(mode string, size int64, desc string) *progress {
	big := size < 0 || size >= progressMin // a stream of unknown length may be big
	show := mode == "always" || mode == "auto" && big && isTerminal(os.Stderr)
	if !show {
		return &progress{}
	}
	total := size // -1: a stream of unknown length, shown as a counter
	if total == 0 {
		total = 1
	}
	return &progress{on: true, bar: progressbar.NewOptions64(total,
		progressbar.OptionSetWriter(os.Stderr),
		progressbar.OptionSetDescription(desc),
		progressbar.OptionShowBytes(true),
		progressbar.OptionShowCount(),
		progressbar.OptionUseIECUnits(true),
		progressbar.OptionThrottle(65*time.Millisecond),
		progressbar.OptionShowElapsedTimeOnFinish(),
		progressbar.OptionSetRenderBlankState(true),
		progressbar.OptionFullWidth(),
	)}
}

// grow raises the bar's total to n bytes.
func (p *progress) grow(n int64) {
	if p.bar != nil {
		p.bar.ChangeMax64(n)
	}
}

func (p *progress) add(n int) {
	if p.bar != nil {
		_ = p.bar.Add(n)
	}
}

// spin ends the bar and runs a spinner for a step that cannot report
// progress (one ioctl).
func (p *progress) spin(desc string) {
	if p.bar == nil {
		return
	}
	p.finish()
	p.on = true
	p.bar = progressbar.NewOptions64(-1,
		progressbar.OptionSetWriter(os.Stderr),
		progressbar.OptionSetDescription(desc),
		progressbar.OptionSpinnerType(14),
		progressbar.OptionSetElapsedTime(true),
		progressbar.OptionSetRenderBlankState(true),
	)
}

// finish fills the bar (or stops the spinner) and ends its line.
func (p *progress) finish() {
	if p.bar == nil || !p.on {
		return
	}
	_ = p.bar.Finish()
	fmt.Fprintln(os.Stderr)
	p.on = false
}

func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
