package fs

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"runtime"
	"strings"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
)

// Mount is a mounted file system.
type Mount struct {
	Dir        string
	server     *fuse.Server
	fs         *FS
	stopFollow context.CancelFunc
}

// MountFS mounts the store at dir and starts serving. A stale FUSE mount
// left at dir by a daemon that died is detached first. As root the mount
// is made with mount(2) directly; otherwise fusermount3 is used.
func MountFS(dir string, o Options) (*Mount, error) {
	f, err := newFS(o)
	if err != nil {
		return nil, err
	}
	return mountWith(f, dir)
}

// mountWith mounts f at dir and starts serving (MountFS).
func mountWith(f *FS, dir string) (*Mount, error) {
	o := f.opts
	if err := PrepareMountpoint(dir); err != nil {
		return nil, err
	}
	et, at, nt := o.EntryTimeout, o.AttrTimeout, o.NegativeTimeout
	if o.Cluster {
		at, nt = 0, 0
		f.opts.AttrTimeout, f.opts.NegativeTimeout = 0, 0
	}
	mo := fuse.MountOptions{
		AllowOther:           o.AllowOther,
		FsName:               "mooncake",
		Name:                 "mooncake",
		MaxWrite:             o.MaxWrite,
		MaxReadAhead:         o.MaxReadAhead,
		MaxBackground:        o.MaxBackground,
		DirectMount:          os.Geteuid() == 0,
		IgnoreSecurityLabels: true,
		Debug:                o.Debug,
		ExtraCapabilities:    fuse.CAP_ATOMIC_O_TRUNC | fuse.CAP_DIRECT_IO_ALLOW_MMAP,
	}
	if o.DefaultPermissions {
		mo.Options = append(mo.Options, "default_permissions")
	}
	if o.Debug {
		mo.Logger = log.New(f.log.WriterLevel(4), "", 0)
	}
	root := f.newNode()
	raw := gofs.NewNodeFS(root, &gofs.Options{
		MountOptions:    mo,
		EntryTimeout:    &et,
		AttrTimeout:     &at,
		NegativeTimeout: &nt,
		RootStableAttr:  &gofs.StableAttr{Ino: 1},
		// Mode 0 is a mode like any other (open(p, O_CREAT, 0) under
		// umask 0 makes a file nobody but root may open, as on tmpfs);
		// without this go-fuse shows it as 0644 or 0755.
		NullPermissions: true,
	})
	procs := runtime.GOMAXPROCS(0)
	server, err := fuse.NewServer(newClosers(renames{raw, &f.renaming, f.moves, new(dirLocks), &f.hooks}), dir, &mo)
	if err != nil {
		return nil, fmt.Errorf("fs: mount %s: %w", dir, err)
	}
	go server.Serve()
	if err := server.WaitMount(); err != nil {
		return nil, fmt.Errorf("fs: mount %s: %w", dir, err)
	}
	spareProcs(procs)
	m := &Mount{Dir: dir, server: server, fs: f}
	ctx, cancel := context.WithCancel(context.Background())
	m.stopFollow = cancel
	if !o.Cluster {
		// (A cluster's watch of the index sees the evictions too.)
		f.followEvictions(ctx, &root.Inode)
	} else if err := f.followIndex(ctx, &root.Inode); err != nil {
		cancel()
		_ = server.Unmount()
		return nil, fmt.Errorf("fs: watch the index: %w", err)
	}
	return m, nil
}

// spareProcs gives the Go scheduler a P more than the server's readers
// can hold. Each reader waits for a request in read(2), a system call
// that keeps its P until the scheduler's monitor takes it back (after
// 20 us or more); with as many Ps as readers, a reader that a request
// wakes often finds every P held by the others, and waits for the
// monitor's next pass before it can serve it (on 2 CPUs, op-get-4KiB's
// p50 was 2.17x the bare round trip with 2 Ps, 1.82x with 4; throughput
// cases did not move). go-fuse runs up to max(2, min(16, procs)) + 1
// readers, procs being GOMAXPROCS when the server was made. The spare
// Ps hold no reader: they run whatever is ready, as any P, which on a
// machine with fewer CPUs than Ps the kernel shares out. A GOMAXPROCS the
// environment sets is left as it is; one set here no longer follows a
// change of the process's CPU quota (Go 1.25's automatic GOMAXPROCS).
func spareProcs(procs int) {
	if os.Getenv("GOMAXPROCS") != "" {
		return
	}
	readers := max(2, min(16, procs)) + 1
	if runtime.GOMAXPROCS(0) < readers+1 {
		runtime.GOMAXPROCS(readers + 1)
	}
}

// Settings returns the negotiated kernel settings for status output.
func (m *Mount) Settings() map[string]any {
	k := m.server.KernelSettings()
	return map[string]any{
		"max_write":      m.fs.opts.MaxWrite,
		"max_readahead":  m.fs.opts.MaxReadAhead,
		"max_background": m.fs.opts.MaxBackground,
		"kernel_abi":     fmt.Sprintf("%d.%d", k.Major, k.Minor),
		"entry_timeout":  m.fs.opts.EntryTimeout.String(),
		"attr_timeout":   m.fs.opts.AttrTimeout.String(),
		"direct_io":      true,
		"splice_reads":   m.fs.splice,
		"go_procs":       runtime.GOMAXPROCS(0), // spareProcs
	}
}

// ErrRequestsRunning is Unmount's error when requests were stuck.
var ErrRequestsRunning = errors.New("requests stuck")

// Unmount detaches the mount and waits until every request in flight,
// commits included, has finished. If files are still open it retries for
// up to timeout, then detaches lazily: the kernel keeps the open files,
// and Unmount serves them until they are closed, however long that
// takes. A request can wait for ever, though (a copy faulting on the
// pages of another file system that stopped answering): when ioctls are
// running and none has ended for timeout, Unmount returns
// ErrRequestsRunning, and the mount's memory is still theirs: the caller
// should exit without releasing it, which also ends the kernel's side of
// the connection and so those requests' calls. Open files alone never
// make it give up.
func (m *Mount) Unmount(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var err error
	for {
		if err = m.server.Unmount(); err == nil {
			break
		}
		if time.Now().After(deadline) {
			if lerr := unix.Unmount(m.Dir, unix.MNT_DETACH); lerr != nil {
				return fmt.Errorf("fs: unmount %s: %w (lazy: %v)", m.Dir, err, lerr)
			}
			open, _ := m.OpenFiles()
			m.fs.log.WithFields(logrus.Fields{"open_files": open, "of_them_dirs": m.OpenDirs()}).Info("detached lazily; serving the open files and directories until they are closed")
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		m.server.Wait()
		m.fs.asyncStop() // submitted calls stop at their next key
		m.fs.async.Wait()
		if m.stopFollow != nil {
			m.stopFollow()
		}
		m.fs.stopProcs()
		m.fs.closeGPUs()
	}()
	tick := time.NewTicker(min(time.Second, timeout))
	defer tick.Stop()
	since := time.Now() // the later of this and the last ioctl's end
	for {
		select {
		case <-done:
			return nil
		case <-tick.C:
		}
		n := m.fs.ioctls.running.Load()
		if n == 0 {
			since = time.Now()
			continue
		}
		if last := time.Unix(0, m.fs.ioctls.lastEnd.Load()); last.After(since) {
			since = last
		}
		if idle := time.Since(since); idle > timeout {
			open, _ := m.OpenFiles()
			return fmt.Errorf("fs: unmount %s: %w: %d ioctls running, none ended for %v (%d files open)",
				m.Dir, ErrRequestsRunning, n, idle.Round(time.Second), open)
		}
	}
}

// Wait blocks until the file system is unmounted (also from outside).
func (m *Mount) Wait() { m.server.Wait() }

// PrepareMountpoint creates dir if needed and detaches a dead FUSE mount
// left there by a daemon that was killed. A mooncake-fs mount that still
// answers is an error: another daemon serves it.
func PrepareMountpoint(dir string) error {
	mounted, err := IsMooncakeMount(dir)
	if err != nil {
		return err
	}
	if mounted {
		// The kernel may answer stat from its attribute cache for a while
		// after the daemon died; getxattr always reaches the daemon.
		switch err := probeMount(dir, 3*time.Second); {
		case err == nil:
			return fmt.Errorf("fs: %s is already a mooncake-fs mount (a daemon serves it)", dir)
		case errors.Is(err, syscall.ENOTCONN) || errors.Is(err, syscall.ECONNABORTED):
			if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
				return fmt.Errorf("fs: detach dead mount at %s: %w", dir, err)
			}
		default:
			return fmt.Errorf("fs: %s is a mooncake-fs mount that does not answer (%v); detach it with umount -l", dir, err)
		}
	}
	_, err = os.Stat(dir)
	switch {
	case err == nil:
	case errors.Is(err, syscall.ENOTCONN) || errors.Is(err, syscall.ECONNABORTED):
		// A dead FUSE mount of another file system.
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("fs: detach stale mount at %s: %w", dir, err)
		}
	case errors.Is(err, os.ErrNotExist):
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("fs: create mountpoint: %w", err)
		}
	default:
		return fmt.Errorf("fs: mountpoint %s: %w", dir, err)
	}
	return nil
}

// probeMount asks the daemon behind dir for its status, giving up after
// timeout (a hung daemon must not hang the new one).
func probeMount(dir string, timeout time.Duration) error {
	done := make(chan error, 1)
	go func() {
		_, err := unix.Getxattr(dir, xattrStatus, make([]byte, 64<<10))
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(timeout):
		return fmt.Errorf("no answer in %v", timeout)
	}
}

// IsMooncakeMount reports whether dir is a mount point of type
// fuse.mooncake according to /proc/self/mountinfo.
func IsMooncakeMount(dir string) (bool, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false, err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		fields := strings.Fields(line)
		if len(fields) < 10 || fields[4] != dir {
			continue
		}
		for i, f := range fields {
			if f == "-" && i+1 < len(fields) && fields[i+1] == "fuse.mooncake" {
				return true, nil
			}
		}
	}
	return false, nil
}
