// Package rediserr tells apart the errors Redis answers that the packages
// above it treat alike, whichever Redis version answered: for now, a key
// holding another Redis type than the script expects (WRONGTYPE), which
// only deleting the key mends.
package rediserr

import (
	"errors"
	"strings"

	"github.com/redis/go-redis/v9"
)

// WrongType reports whether err is Redis's WRONGTYPE error: a command,
// or a script's call, ran on a key holding another type. Redis 7 answers
// a script whose call failed with the call's error ("WRONGTYPE Operation
// against a key holding the wrong kind of value script: ..."); Redis
// before 7 wraps it ("ERR Error running script (call to f_...):
// @user_script:1: WRONGTYPE Operation against ...").
func WrongType(err error) bool {
	var re redis.Error
	if !errors.As(err, &re) {
		return false
	}
	msg := re.Error()
	if strings.HasPrefix(msg, "WRONGTYPE") {
		return true
	}
	script, ok := strings.CutPrefix(msg, "ERR Error running script")
	return ok && strings.Contains(script, ": WRONGTYPE ")
}
