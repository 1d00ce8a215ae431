//! Flags given where they do not apply are refused, with a message naming
//! the command that does take them; none is silently dropped.
//!
//! Three cases:
//! - a flag the subcommand does not take (`edl-runtime launch --hidden 64`):
//!   clap's unknown-argument error, with a tip naming the commands that
//!   take the flag (found by walking the command tree, aliases included);
//! - a flag before a subcommand (`edl-runtime --max-workers 8 launch`):
//!   the top level is the built-in job, so clap would take the flag there
//!   and the subcommand never see it; refused, saying where it goes;
//! - a flag of `launch` that `launch --torchrun` does not use (the script
//!   trains, checkpoints and distils on its own): refused when it was
//!   given on the command line.
//!
//! Each check is given `root`, the command tree as defined
//! (`Cli::command()`, not yet built), by the parser in `mod.rs`.

use super::launch::TORCHRUN_FLAGS;
use clap::{
    Arg, ArgMatches, Command,
    error::{ContextKind, ContextValue, ErrorKind},
    parser::ValueSource,
};
use std::ffi::OsString;

/// Adds to clap's unknown-argument error which commands take the flag.
/// Other errors, and flags no command takes, are left as clap made them.
pub fn explain(root: &Command, mut err: clap::Error, args: &[OsString]) -> clap::Error {
    if err.kind() != ErrorKind::UnknownArgument {
        return err;
    }
    let Some(ContextValue::String(given)) = err.get(ContextKind::InvalidArg) else { return err };
    // `launch python train.py`: the program goes after `--`.
    let here = command_path(root, args);
    if !given.starts_with('-') && here.last().is_some_and(|c| c == "launch") {
        let tip = format!("the program to run goes after `--`: `edl-runtime launch [FLAGS] -- {given} ...`");
        err.insert(ContextKind::Suggested, ContextValue::StyledStrs(vec![tip.into()]));
        return err;
    }
    let Some(long) = given.strip_prefix("--").and_then(|l| l.split('=').next()) else { return err };
    let takers = takers(root, long);
    if takers.is_empty() {
        return err;
    }
    let tip = format!("`--{long}` is a flag of {}, not of {}", names(&takers), name(&here));
    err.insert(ContextKind::Suggested, ContextValue::StyledStrs(vec![tip.into()]));
    err
}

/// `edl-runtime --max-workers 8 launch ...`: the top level is the built-in
/// job, whose flags a subcommand never sees. Read from the command line
/// itself, so the flag is named even where the subcommand's own parse
/// would fail first (`edl-runtime --policy P plugin replay` lacks --policy).
pub fn misplaced(root: &Command, args: &[OsString]) -> Result<(), clap::Error> {
    let mut before: Option<(&str, String)> = None;
    let mut words = args.iter().skip(1).filter_map(|a| a.to_str());
    while let Some(w) = words.next() {
        if w == "--" {
            break;
        }
        if let Some(flag) = w.strip_prefix("--") {
            let (long, inline) = match flag.split_once('=') {
                Some((l, v)) => (l, Some(v)),
                None => (flag, None),
            };
            let Some(arg) = root.get_arguments().find(|a| is_named(a, long)) else { continue };
            let mut given = format!("--{long}");
            if arg.get_action().takes_values()
                && let Some(v) = inline.or_else(|| words.next())
            {
                given = format!("{given} {v}");
            }
            if before.is_none() && !arg.is_global_set() {
                before = Some((long, given));
            }
        } else if !w.starts_with('-') && root.find_subcommand(w).is_some() {
            let Some((long, given)) = before else { return Ok(()) };
            let path = command_path(root, args);
            let message = if takes_flag(subcommand(root, &path), long) {
                format!("`{given}` goes after the subcommand: edl-runtime {} {given} ...", path.join(" "))
            } else {
                format!("`--{long}` is a flag of {}, not of {}", names(&takers(root, long)), name(&path))
            };
            return Err(refusal(root, &path, message));
        } else {
            // A positional word of the built-in job: there is none, so clap refuses it.
            return Ok(());
        }
    }
    Ok(())
}

/// `launch --torchrun` with a flag only a job of steps uses (given on the
/// command line; an environment variable such as $EDL_STORE is no flag).
pub fn unused_by_torchrun(root: &Command, matches: &ArgMatches) -> Result<(), clap::Error> {
    let Some(("launch", launch)) = matches.subcommand() else { return Ok(()) };
    if !launch.get_flag("torchrun") {
        return Ok(());
    }
    let path = ["launch".to_string()];
    let cmd = subcommand(root, &path);
    for arg in cmd.get_arguments().filter(|a| !a.is_global_set()) {
        let id = arg.get_id().as_str();
        if TORCHRUN_FLAGS.contains(&id) || launch.value_source(id) != Some(ValueSource::CommandLine) {
            continue;
        }
        let long = arg.get_long().unwrap_or_default();
        let hint = match id {
            "decide_every_steps" => " (a torchrun group's policy decides every --decide-secs seconds)",
            "teachers" | "service" => " (a torchrun script calls its own teachers)",
            _ => "",
        };
        let takes: Vec<String> = torchrun_flags(cmd).iter().map(|f| format!("--{f}")).collect();
        let message = format!(
            "`--{long}` is a flag of `edl-runtime launch` without --torchrun and of the built-in job \
             (`edl-runtime [job flags]`): a torchrun script trains, checkpoints and distils on its \
             own{hint}. `launch --torchrun` takes {} and the plugin sandbox flags",
            takes.join(", ")
        );
        return Err(refusal(root, &path, message));
    }
    across_hosts_only(root, launch, &path)
}

/// `launch --torchrun` on this host (`--scaler local`) with a flag of a
/// group across hosts.
fn across_hosts_only(root: &Command, launch: &ArgMatches, path: &[String]) -> Result<(), clap::Error> {
    let given = |id: &str| launch.value_source(id) == Some(ValueSource::CommandLine);
    let local =
        launch.get_one::<super::flags::ScalerKind>("scaler") == Some(&super::flags::ScalerKind::Local);
    if !local {
        return Ok(());
    }
    for (id, long) in [
        ("nproc_per_node", "--nproc-per-node"),
        ("listen", "--listen"),
        ("advertise", "--advertise"),
        ("secret_file", "--secret-file"),
        ("store", "--store"),
        ("standby", "--standby"),
        ("worker_reconnect_secs", "--worker-reconnect-secs"),
    ] {
        if given(id) {
            return Err(refusal(
                root,
                path,
                format!(
                    "`{long}` is for a torchrun group across hosts (--scaler command or external, an agent \
                     per host); on this host --min-workers / --max-workers count the ranks"
                ),
            ));
        }
    }
    Ok(())
}

/// The long names of the flags `launch --torchrun` takes.
fn torchrun_flags(launch: &Command) -> Vec<&str> {
    launch
        .get_arguments()
        .filter(|a| TORCHRUN_FLAGS.contains(&a.get_id().as_str()) && a.get_id() != "torchrun")
        .filter_map(Arg::get_long)
        .collect()
}

/// A usage error of the command at `path`, shown with its usage line.
fn refusal(root: &Command, path: &[String], message: String) -> clap::Error {
    let mut root = root.clone();
    root.build();
    let mut cmd = &mut root;
    for name in path {
        if cmd.find_subcommand(name).is_none() {
            break;
        }
        cmd = cmd.find_subcommand_mut(name).expect("found above");
    }
    cmd.error(ErrorKind::ArgumentConflict, message)
}

/// Whether `cmd` itself takes `--long` (by its name or an alias).
fn takes_flag(cmd: &Command, long: &str) -> bool {
    cmd.get_arguments().any(|a| !a.is_global_set() && is_named(a, long))
}

fn is_named(a: &Arg, long: &str) -> bool {
    a.get_long() == Some(long) || a.get_all_aliases().is_some_and(|all| all.contains(&long))
}

/// Every command (by its path of subcommands; the root is the empty path)
/// that takes `--long`.
pub fn takers(root: &Command, long: &str) -> Vec<Vec<String>> {
    fn walk(cmd: &Command, path: &mut Vec<String>, long: &str, out: &mut Vec<Vec<String>>) {
        if takes_flag(cmd, long) {
            out.push(path.clone());
        }
        for sub in cmd.get_subcommands() {
            path.push(sub.get_name().to_string());
            walk(sub, path, long, out);
            path.pop();
        }
    }
    let mut out = Vec::new();
    walk(root, &mut Vec::new(), long, &mut out);
    out
}

fn subcommand<'a>(root: &'a Command, path: &[String]) -> &'a Command {
    path.iter().fold(root, |cmd, name| cmd.find_subcommand(name).unwrap_or(cmd))
}

/// The subcommands a command line names, in order, skipping flags and
/// their values (so `--job launch` is not taken for the subcommand).
pub fn command_path(root: &Command, args: &[OsString]) -> Vec<String> {
    let globals: Vec<&Arg> = root.get_arguments().filter(|a| a.is_global_set()).collect();
    let (mut cmd, mut path) = (root, Vec::new());
    let mut words = args.iter().skip(1).filter_map(|a| a.to_str());
    while let Some(w) = words.next() {
        if w == "--" {
            break;
        }
        if let Some(long) = w.strip_prefix("--") {
            let arg = cmd.get_arguments().chain(globals.iter().copied()).find(|a| is_named(a, long));
            if !long.contains('=') && arg.is_some_and(|a| a.get_action().takes_values()) {
                words.next();
            }
        } else if !w.starts_with('-')
            && let Some(sub) = cmd.find_subcommand(w)
        {
            path.push(sub.get_name().to_string());
            cmd = sub;
        }
    }
    path
}

/// A command, for a message.
fn name(path: &[String]) -> String {
    if path.is_empty() {
        "the built-in job (`edl-runtime [job flags]`)".to_string()
    } else {
        format!("`edl-runtime {}`", path.join(" "))
    }
}

/// Commands, for a message: `A`, `A and B`, `A, B and C`.
fn names(paths: &[Vec<String>]) -> String {
    let all: Vec<String> = paths.iter().map(|p| name(p)).collect();
    match all.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => String::new(),
    }
}
