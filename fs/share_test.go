package fs

import (
	"context"
	"sync"
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// TestIoctlUserShare: a user other than root runs at most
// maxIoctlsPerUser data-path ioctls at once (calls held here by a test
// hook, as calls whose copies wait on a stalled mapping would be); the
// next one gets EBUSY and changes nothing, while another user's and
// root's still run, and once the calls end the user's run again.
func TestIoctlUserShare(t *testing.T) {
	fx := newFuzzFixture(t)
	as := func(uid uint32) context.Context {
		return fuse.NewContext(context.Background(), &fuse.Caller{Owner: fuse.Owner{Uid: uid, Gid: uid}, Pid: 1})
	}
	release := make(chan struct{})
	var entered sync.WaitGroup
	ioctlHook = func(cmd uint32) {
		if cmd == ioctl.CmdStat {
			entered.Done()
			<-release
		}
	}
	t.Cleanup(func() { ioctlHook = nil })
	stat := func(ctx context.Context) syscall.Errno {
		out := make([]byte, ioctl.SizeStatArg)
		_, errno := fx.file.Ioctl(ctx, fx.fh, ioctl.CmdStat, 0, (&ioctl.StatArg{}).Marshal(), out)
		return errno
	}
	// A cheap call that the hook lets through: a batch of no keys.
	probe := func(ctx context.Context) syscall.Errno {
		out := make([]byte, ioctl.SizeBatchArg)
		_, errno := fx.root.Ioctl(ctx, fx.dh, ioctl.CmdBatchGet, 0, (&ioctl.BatchArg{Source: ioctl.BatchVM}).Marshal(), out)
		return errno
	}
	var done sync.WaitGroup
	entered.Add(maxIoctlsPerUser)
	for range maxIoctlsPerUser {
		done.Go(func() { stat(as(1000)) })
	}
	entered.Wait()
	if errno := probe(as(1000)); errno != syscall.EBUSY {
		t.Fatalf("user 1000's call past its share: %v, want EBUSY", errno)
	}
	for _, uid := range []uint32{1001, 0} {
		if errno := probe(as(uid)); errno != 0 {
			t.Fatalf("user %d's call while 1000 holds its share: %v", uid, errno)
		}
	}
	if errno := probe(context.Background()); errno == syscall.EBUSY {
		t.Fatalf("a call with no caller (counted as root's): %v", errno)
	}
	if n := fx.root.fs.ioctls.byUser.count(); n != maxIoctlsPerUser {
		t.Fatalf("%d calls counted, want %d", n, maxIoctlsPerUser)
	}
	close(release)
	done.Wait()
	if errno := probe(as(1000)); errno != 0 {
		t.Fatalf("user 1000's call after its calls ended: %v", errno)
	}
	if n := fx.root.fs.ioctls.byUser.count(); n != 0 {
		t.Fatalf("%d calls still counted", n)
	}
}
