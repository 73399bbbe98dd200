package fs

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
)

func TestErrno(t *testing.T) {
	for _, c := range []struct {
		err  error
		want syscall.Errno
	}{
		{nil, 0},
		{store.ErrNotFound, syscall.ENOENT},
		{fmt.Errorf("get %q: %w", "k", store.ErrNotFound), syscall.ENOENT},
		{fmt.Errorf("a: %w", fmt.Errorf("b: %w", store.ErrNotEmpty)), syscall.ENOTEMPTY},
		{errors.Join(store.ErrNoSpace, segment.ErrNoSpace), syscall.ENOSPC},
		{fmt.Errorf("alloc: %w", segment.ErrNoSpace), syscall.ENOSPC},
		{store.ErrNameTooLong, syscall.ENAMETOOLONG},
		{fmt.Errorf("x: %w", syscall.EXDEV), syscall.EXDEV},
		{syscall.ENOSYS, syscall.EIO},
		{context.Canceled, syscall.EINTR},
		{errors.New("something unknown"), syscall.EIO},
	} {
		if got := toErrno(c.err); got != c.want {
			t.Errorf("toErrno(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
