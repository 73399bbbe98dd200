package transfer

import "errors"

// Sentinel errors; fs/ maps them to errno.
var (
	ErrBadRequest = errors.New("transfer: bad request")
	ErrNoStrategy = errors.New("transfer: no strategy for request")
	ErrClosed     = errors.New("transfer: engine closed")
	ErrFault      = errors.New("transfer: address outside the process's memory")
	ErrNoProcess  = errors.New("transfer: process gone")
)
