package fs

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
)

// mountFixture mounts a store of its own at a temporary directory, in
// this process, with hook setting the FS's test hooks first (before the
// server's goroutines start). It skips without root or /dev/fuse.
func mountFixture(t *testing.T, hook func(f *FS)) (*FS, string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("no /dev/fuse")
	}
	fx := newFixtureOf(t, 16<<20)
	o := DefaultOptions()
	o.Store = fx.st
	o.Log = logrus.New()
	o.Log.SetOutput(io.Discard)
	f, err := newFS(o)
	if err != nil {
		t.Fatal(err)
	}
	hook(f)
	dir := t.TempDir()
	m, err := mountWith(f, dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := m.Unmount(10 * time.Second); err != nil {
			t.Error(err)
		}
	})
	return f, dir
}

// TestCommitFollowsRenameAndBack: a writer closes its appended file while
// another process renames the file away and back. The close's commit
// finds the name empty (the store moved the file, the tree had not), and
// by the time it looks again the file is back under that very name; it
// must commit there. It used to take the file for removed and publish
// nothing, and when the release's commit missed the same way the append
// was lost: one in about 70,000 appends to a log renamed back and forth.
// (A dup of the descriptor holds the release back, so that the close's
// own commit is what the test sees; an fsync cannot race a rename of its
// file: the kernel holds the inode's lock across both.)
func TestCommitFollowsRenameAndBack(t *testing.T) {
	moved, resume := make(chan struct{}), make(chan struct{})
	renamedAway := make(chan error, 1)
	backErr := make(chan error, 1)
	var once, staleOnce, resumeOnce sync.Once
	release := func() { resumeOnce.Do(func() { close(resume) }) }
	var f *FS
	var dir string
	f, dir = mountFixture(t, func(mf *FS) {
		mf.hooks.storeRenamed = func(from, to string) {
			if to == "log.1" {
				// The first rename away waits here, between the store
				// and the tree, until the writer's commit missed.
				once.Do(func() {
					close(moved)
					<-resume
				})
			}
		}
		mf.hooks.commitStale = func(key string) {
			staleOnce.Do(func() {
				// The rename away ends, and the file comes back under
				// the name the commit tried, before it looks again.
				release()
				if err := <-renamedAway; err != nil {
					backErr <- err
					return
				}
				backErr <- os.Rename(filepath.Join(dir, "log.1"), filepath.Join(dir, "log"))
			})
		}
	})
	p := filepath.Join(dir, "log")
	if err := os.WriteFile(p, []byte("first\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	w, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close() // (a second close is harmless; unmounting waits for the first)
	if _, err := w.WriteString("second\n"); err != nil {
		t.Fatal(err)
	}
	fd, err := syscall.Dup(int(w.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	dup := os.NewFile(uintptr(fd), "dup")
	defer dup.Close()
	defer release() // (a rename left waiting would hold the unmount)
	go func() { renamedAway <- os.Rename(p, filepath.Join(dir, "log.1")) }()
	select {
	case <-moved:
	case err := <-renamedAway:
		t.Fatalf("rename: %v, without its hook", err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-backErr:
		if err != nil {
			t.Fatal(err)
		}
	default:
		t.Fatal("the close's commit never missed its file: the test's hooks did not run")
	}
	// Published by the close, as a get by name sees it.
	if o, err := f.st.Stat(context.Background(), "log"); err != nil {
		t.Fatal(err)
	} else if o.Size != 13 {
		t.Fatalf("after the close: %d bytes published, want 13", o.Size)
	}
	if err := dup.Close(); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if want := []byte("first\nsecond\n"); !bytes.Equal(got, want) {
		t.Fatalf("after the rename away and back: %q, want %q", got, want)
	}
}

// TestLookupDuringRename: a lookup that revalidates a cached name (which
// the kernel sends without the directory's lock) reads the store, and a
// whole rename of the file could run before go-fuse's tree entered the
// answer: the tree then gave the file its old name back, and a writer's
// close committed there, found nothing and dropped the append (about one
// in 10,000 appends to a file renamed back and forth while another
// process stats it, with an entry timeout of 0). The rename now waits
// for the lookup.
func TestLookupDuringRename(t *testing.T) {
	var armed, paused atomic.Bool
	looked, renameWaiting, renameDone := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var waitOnce sync.Once
	f, dir := mountFixture(t, func(mf *FS) {
		mf.opts.EntryTimeout = 0 // every walk revalidates its names
		mf.hooks.lookedUp = func(name string) {
			// The first lookup of log once armed (the stat's) pauses;
			// others (the rename's own walk) go on.
			if name != "log" || !armed.Load() || !paused.CompareAndSwap(false, true) {
				return
			}
			close(looked)
			// The rename runs whole (nothing keeps it from the
			// directory), or waits for this lookup.
			select {
			case <-renameDone:
			case <-renameWaiting:
			}
		}
		mf.hooks.renameWaits = func() {
			if armed.Load() {
				waitOnce.Do(func() { close(renameWaiting) })
			}
		}
	})
	p, moved := filepath.Join(dir, "log"), filepath.Join(dir, "log.1")
	if err := os.WriteFile(p, []byte("first\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	w, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := w.WriteString("second\n"); err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	statErr := make(chan error, 1)
	go func() {
		_, err := os.Stat(p)
		statErr <- err
	}()
	<-looked
	var renameErr error
	go func() {
		defer close(renameDone)
		renameErr = os.Rename(p, moved)
	}()
	if err := <-statErr; err != nil {
		t.Fatal(err)
	}
	<-renameDone
	if renameErr != nil {
		t.Fatal(renameErr)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if o, err := f.st.Stat(context.Background(), "log.1"); err != nil {
		t.Fatal(err)
	} else if o.Size != 13 {
		t.Fatalf("after the close: %d bytes published at the file's name, want 13", o.Size)
	}
	if got, err := os.ReadFile(moved); err != nil || string(got) != "first\nsecond\n" {
		t.Fatalf("%s: %q, %v", moved, got, err)
	}
}

// TestRewriteDuringRename: an O_TRUNC rewrite of a file that another
// process holds open read-write without writing moves that holder's
// shared draft onto the new version (rebaseShared), else the next append
// through it would publish the old content over the rewrite. A rename
// between the rewrite's commit and that move made the move look for the
// file at a name the store no longer had, and it kept the old content:
// about 3% of rewrites then appends while another thread renamed the
// file back and forth lost the rewrite. The move now finds the file
// with the renames in flight done.
func TestRewriteDuringRename(t *testing.T) {
	var armed atomic.Bool
	moved, resume := make(chan struct{}), make(chan struct{})
	var resumeOnce sync.Once
	release := func() { resumeOnce.Do(func() { close(resume) }) }
	renameErr := make(chan error, 1)
	var dir string
	_, dir = mountFixture(t, func(mf *FS) {
		mf.hooks.rewritten = func() {
			if !armed.CompareAndSwap(true, false) {
				return
			}
			// A rename of the file starts, and its store step is done
			// before the shared draft looks for the new version.
			go func() { renameErr <- os.Rename(filepath.Join(dir, "f"), filepath.Join(dir, "g")) }()
			select {
			case <-moved:
			case err := <-renameErr:
				renameErr <- err
			}
		}
		mf.hooks.storeRenamed = func(from, to string) {
			if to == "g" {
				close(moved)
				<-resume
			}
		}
		mf.hooks.settling = release
	})
	defer release() // (a rename left waiting would hold the unmount)
	p, q := filepath.Join(dir, "f"), filepath.Join(dir, "g")
	if err := os.WriteFile(p, []byte("old\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	holder, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	armed.Store(true)
	if err := os.WriteFile(p, []byte("new\n"), 0o644); err != nil { // O_TRUNC
		t.Fatal(err)
	}
	release()
	if armed.Load() {
		t.Fatal("the rewrite's hook did not run")
	}
	if err := <-renameErr; err != nil {
		t.Fatal(err)
	}
	a, err := os.OpenFile(q, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.WriteString("appended\n"); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(q); err != nil || string(got) != "new\nappended\n" {
		t.Fatalf("%s: %q, %v; want the rewrite and the append", q, got, err)
	}
}
