package store

import (
	"errors"
	"strconv"
)

// Sentinel errors. Callers match them with errors.Is; fs/ maps them to errno.
var (
	ErrNotFound    = errors.New("store: no such key")
	ErrExists      = errors.New("store: key exists")
	ErrConflict    = errors.New("store: version conflict")
	ErrNotDir      = errors.New("store: not a directory")
	ErrIsDir       = errors.New("store: is a directory")
	ErrNotEmpty    = errors.New("store: directory not empty")
	ErrNameTooLong = errors.New("store: name too long")
	ErrInvalidName = errors.New("store: invalid name")
	ErrNoSpace     = errors.New("store: no space")
	ErrStale       = errors.New("store: object replaced or removed")
	ErrLost        = errors.New("store: no surviving replica")
	ErrInvalid     = errors.New("store: invalid argument")
	ErrTooLarge    = errors.New("store: too large")
	ErrClosed      = errors.New("store: closed")
	// ErrMoved means a draft no longer continues the bytes a reader of it
	// asked for (Draft.ReadAtFrom).
	ErrMoved       = errors.New("store: draft moved onto other bytes")
	ErrUnsupported = errors.New("store: unsupported")
	ErrRange       = errors.New("store: offset outside the object")
	// ErrUnavailable means a shared index (etcd) did not answer: the
	// change did not happen, or its outcome is unknown.
	ErrUnavailable = errors.New("store: index unavailable")
	// ErrRemote means the held bytes live on another node: Reader.Slices
	// cannot map them; callers (fs) fall back to ReadAt / ReadTo.
	ErrRemote = errors.New("store: bytes on a remote node")
)

// keyError wraps a sentinel with the operation and key. It formats only
// when printed: lookups that miss are common and must stay cheap.
type keyError struct {
	op, key string
	err     error
}

func (e *keyError) Error() string { return e.op + " " + strconv.Quote(e.key) + ": " + e.err.Error() }
func (e *keyError) Unwrap() error { return e.err }
